"""`quartctl bench loadgen [--out FILE]`: how fast and how punctual the load generator is.

Starts a trivial HTTP/1.1 keep-alive server in a separate process (so the client has a core of its
own) on an ephemeral loopback port, sends Poisson arrivals open loop at the target rate, and writes
``{rps, send_error_p99_ms, ...}``. The server (``python -m quart_tools.bench.loadgen --serve``) is
also what the tests use as a slow server (``--delay-ms``).
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
from quart_stage import cliargs
from quart_tools.bench import write_report

RESPONSE_BODY = b'{"ok":true}'
SERVER_NICE = 10  # the benchmark's server yields the CPU to the client being measured


class _TrivialHTTP(asyncio.Protocol):
    """Parses just enough HTTP/1.1 (headers + Content-Length body) to answer 200, keep-alive."""

    delay_s = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            pos = head.find(b"content-length:")
            if pos >= 0:
                line_end = head.find(b"\r\n", pos)
                length = int(head[pos + 15 : line_end if line_end >= 0 else len(head)].strip() or 0)
            total = end + 4 + length
            if len(self.buf) < total:
                return
            self.buf = self.buf[total:]
            reply = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Quart-Stage-0-Compute-Ms: 0.5\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(RESPONSE_BODY), RESPONSE_BODY))
            if self.delay_s > 0:
                asyncio.get_running_loop().call_later(self.delay_s, self._send, reply)
            else:
                self.transport.write(reply)

    def _send(self, reply: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(reply)


def serve(delay_ms: float = 0.0) -> None:
    """Serve on 127.0.0.1:<ephemeral>, print the port on stdout, run until killed or stdin closes."""
    import uvloop

    async def _main() -> None:
        loop = asyncio.get_running_loop()
        _TrivialHTTP.delay_s = delay_ms / 1000.0
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        server = await loop.create_server(_TrivialHTTP, sock=sock, backlog=4096)
        print(sock.getsockname()[1], flush=True)
        # Exit when the parent closes our stdin (so no orphan survives a crashed parent).
        await loop.run_in_executor(None, sys.stdin.read)
        server.close()

    uvloop.run(_main())


@contextmanager
def trivial_server(delay_ms: float = 0.0, nice: int = 0):
    """Run :func:`serve` in a child process; yields its base URL; always kills it.

    ``nice`` > 0 lowers the server's CPU priority, so on a busy machine the scheduler serves the
    load generator (whose punctuality is measured) first.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "quart_tools.bench.loadgen", "--serve", "--delay-ms", str(delay_ms)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        preexec_fn=(lambda: os.nice(nice)) if nice > 0 else None,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip().isdigit():
            raise RuntimeError(f"trivial server did not start (printed {line!r})")
        yield f"http://127.0.0.1:{int(line)}/"
    finally:
        try:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=3)


def run_once(rate: float, duration_s: float, seed: int = 0) -> dict:
    """One run against a fresh trivial server: achieved rate and send-time error."""
    from quart_tools.arrivals import poisson_arrivals
    from quart_tools.loadgen import generate_load

    arrivals = poisson_arrivals(rate, duration_s, seed=seed, input_bytes=1024)
    load_before = os.getloadavg()[0]
    with trivial_server(nice=SERVER_NICE) as url:
        result = generate_load(url, arrivals, timeout_s=10.0)
    err = result.send_error_ms()
    err = err[~np.isnan(err)]
    lat = np.array([r.latency_ms for r in result.records if r.ok])
    return {
        "rps": round(result.achieved_rps(), 1),
        "send_error_p99_ms": round(float(np.percentile(err, 99)), 3) if len(err) else math.nan,
        "send_error_p50_ms": round(float(np.percentile(err, 50)), 3) if len(err) else math.nan,
        "requests": len(result.records),
        "ok": sum(r.ok for r in result.records),
        "latency_p50_ms": round(float(np.percentile(lat, 50)), 3) if len(lat) else math.nan,
        "loadavg_before": round(load_before, 2),
    }


def run_bench(rate: float, duration_s: float, repeats: int = 3, seed: int = 0) -> dict:
    """``repeats`` runs; the headline figures are the run with the median send-error p99.

    Other engineers share this machine: a run caught by a burst of their load shows stalls of
    100+ ms that are not the generator's. Every run is listed in ``runs``.
    """
    runs = [run_once(rate, duration_s, seed + k) for k in range(repeats)]
    median = sorted(runs, key=lambda r: r["send_error_p99_ms"])[len(runs) // 2]
    return {
        "rps": median["rps"],
        "send_error_p99_ms": median["send_error_p99_ms"],
        "target_rps": rate,
        "duration_s": duration_s,
        "repeats": repeats,
        "runs": runs,
        "machine": f"{os.cpu_count()} cores, Python {sys.version.split()[0]}",
    }


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the JSON here (default stdout)")
    p.add_argument("--rate", type=float, default=2000.0, help="target requests/s")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per run")
    p.add_argument("--repeats", type=int, default=3, help="runs; the median one is the headline")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    started = time.time()
    out = run_bench(args.rate, args.duration, args.repeats, args.seed)
    out["wall_s"] = round(time.time() - started, 2)
    write_report(out, args.out, always_print=True)
    return 0


if __name__ == "__main__":
    ap = cliargs.ArgumentParser()
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ns = ap.parse_args()
    if ns.serve:
        serve(ns.delay_ms)
