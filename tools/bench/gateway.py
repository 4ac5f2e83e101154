"""`quartctl bench gateway`: latency added by one gateway hop, and requests/s through the gateway.

Starts `quartctl up --process-hosts` (a real gateway process), deploys the built-in ``quart/echo``
function (a raw-asyncio HTTP/1.1 echo replica, see :mod:`.echo`), and drives it with one lean
keep-alive client: the same client, body and connection handling for both paths.

- Latency: requests alternate between the replica directly and the same replica through the
  gateway (order flipped every pair), one at a time; added = gateway − direct percentiles.
- Throughput: ``--concurrency`` keep-alive connections through the gateway for ``--seconds``;
  the same against the replica directly for the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from quart_provider.system import stop_process
from quart_tools.bench import machine_info, write_report
from tqdm import tqdm


class Connection:
    """One keep-alive HTTP/1.1 connection with a minimal request/response codec."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> Connection:
        host_port = url.split("://", 1)[1].split("/", 1)[0]
        host, port = host_port.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, host_port)

    def request_bytes(self, path: str, body: bytes) -> bytes:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        return head.encode() + body

    async def send(self, raw: bytes) -> int:
        """Send a pre-encoded request; returns the status after reading the whole response."""
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
                break
        if length:
            await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _latency(gateway_url: str, replica_url: str, body: bytes, count: int, warmup: int) -> dict:
    gw = await Connection.open(gateway_url)
    direct = await Connection.open(replica_url)
    gw_raw, direct_raw = gw.request_bytes("/function/echo", body), direct.request_bytes("/", body)
    times = {"gateway": [], "direct": []}
    pairs = [(gw, gw_raw, "gateway"), (direct, direct_raw, "direct")]
    clock = time.perf_counter
    for i in tqdm(range(warmup + count), desc="latency pairs", disable=not sys.stderr.isatty()):
        order = pairs if i % 2 == 0 else pairs[::-1]
        for conn, raw, name in order:
            start = clock()
            status = await conn.send(raw)
            elapsed = clock() - start
            if status != 200:
                raise RuntimeError(f"{name} request answered {status}")
            if i >= warmup:
                times[name].append(elapsed * 1000)
    gw.close()
    direct.close()
    out = {}
    for name, values in times.items():
        out[f"p50_{name}_ms"] = _pct(values, 0.50)
        out[f"p99_{name}_ms"] = _pct(values, 0.99)
        out[f"mean_{name}_ms"] = statistics.fmean(values)
    out["p50_added_ms"] = out["p50_gateway_ms"] - out["p50_direct_ms"]
    out["p99_added_ms"] = out["p99_gateway_ms"] - out["p99_direct_ms"]
    return out


async def _throughput(url: str, path: str, body: bytes, concurrency: int, seconds: float) -> float:
    conns = [await Connection.open(url) for _ in range(concurrency)]
    raw = conns[0].request_bytes(path, body)
    done = 0
    errors = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds

    async def worker(conn: Connection) -> None:
        nonlocal done, errors
        while loop.time() < deadline:
            if await conn.send(raw) == 200:
                done += 1
            else:
                errors += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - start
    for conn in conns:
        conn.close()
    if errors:
        raise RuntimeError(f"{errors} requests to {url}{path} failed during the throughput run")
    return done / elapsed


def _start_gateway(state_dir: Path) -> tuple[subprocess.Popen, str, tuple[str, str]]:
    log = open(state_dir / "gateway.log", "wb")  # noqa: SIM115 - closed by the caller via the process
    process = subprocess.Popen(
        [sys.executable, "-m", "quart_tools.cli", "up", "--port", "0", "--process-hosts", "--no-plugin",
         "--state-dir", str(state_dir)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    deadline = time.monotonic() + 60
    state_file = state_dir / "up.json"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited: {(state_dir / 'gateway.log').read_text()[-2000:]}")
        if state_file.exists():
            state = json.loads(state_file.read_text())
            password = Path(state["password_file"]).read_text().strip()
            return process, state["url"], (state["user"], password)
        time.sleep(0.05)
    stop_process(process.pid, process)
    raise RuntimeError("gateway did not start in 60 s")


def run(body_bytes: int, count: int, warmup: int, concurrency: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="quart-bench-gw-") as tmp:
        process, url, auth = _start_gateway(Path(tmp))
        try:
            res = requests.post(f"{url}/system/functions", auth=auth, timeout=30,
                                json={"service": "echo", "image": "quart/echo:latest"})
            res.raise_for_status()
            deadline = time.monotonic() + 60
            while True:
                listing = requests.get(f"{url}/system/replicas/echo", auth=auth, timeout=10).json()
                ready = [r for r in listing["replicas"] if r["state"] == "ready"]
                if ready:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("echo replica not ready in 60 s")
                time.sleep(0.05)
            replica_url = ready[0]["url"]
            body = os.urandom(body_bytes)
            try:
                import uvloop

                uvloop.install()
            except ImportError:  # pragma: no cover
                pass
            latency = asyncio.run(_latency(url, replica_url, body, count, warmup))
            rps = asyncio.run(_throughput(url, "/function/echo", body, concurrency, seconds))
            direct_rps = asyncio.run(_throughput(replica_url, "/", body, concurrency, seconds))
        finally:
            stop_process(process.pid, process)
    return {
        **{k: round(v, 4) for k, v in latency.items()},
        "rps": round(rps, 1),
        "direct_rps": round(direct_rps, 1),
        "rps_ratio_gateway_vs_direct": round(rps / direct_rps, 3) if direct_rps else None,
        "body_bytes": body_bytes, "latency_requests": count, "concurrency": concurrency, "seconds": seconds,
        "replica": "built-in quart/echo (raw asyncio HTTP/1.1 echo, uvloop)",
        "machine": machine_info(),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="quartctl bench gateway", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout)")
    p.add_argument("--body-bytes", type=int, default=1024)
    p.add_argument("--requests", type=int, default=3000, help="latency pairs measured (after warm-up)")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16, help="keep-alive connections in the throughput run")
    p.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    args = p.parse_args(argv)
    result = run(args.body_bytes, args.requests, args.warmup, args.concurrency, args.seconds)
    write_report(result, args.out, always_print=True)
    return 0
