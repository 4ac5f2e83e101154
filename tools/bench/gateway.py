"""`quartctl bench gateway`: latency added by one gateway hop, and requests/s through the gateway.

Starts `quartctl up --process-hosts` (a real gateway process), deploys the built-in ``quart/echo``
function (a raw-asyncio HTTP/1.1 echo replica, see :mod:`quart_provider.echo`), and drives both paths
(the replica directly, and ``/function/echo`` through the gateway) with the same client and body:

- Latency (single requests): a lean keep-alive client alternates requests between the two paths
  (order flipped every pair), one at a time; added = gateway − direct percentiles.
- Throughput (closed loop): ``--connections`` keep-alive connections for ``--seconds`` per path, from
  ``wrk`` (:mod:`.wrk`; found on PATH, or installed with apt-get when root) — a C client that is not
  the bottleneck — or, when it is missing or ``--client python``, our asyncio client; the JSON says
  which (``client``). wrk's latency percentiles under that load are reported too (``loaded``).
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
from quart_stage import cliargs
from quart_tools.bench import machine_info, write_report
from quart_tools.bench.wrk import find_wrk, run_wrk, version, write_script
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


def _start_gateway(state_dir: Path, plugin: bool = False, env: dict[str, str] | None = None
                   ) -> tuple[subprocess.Popen, str, tuple[str, str]]:
    """`quartctl up --process-hosts` in ``state_dir`` (with the QUART plugin when ``plugin``); its URL and auth."""
    log = open(state_dir / "gateway.log", "wb")  # noqa: SIM115 - closed by the caller via the process
    process = subprocess.Popen(
        [sys.executable, "-m", "quart_tools.cli", "up", "--port", "0", "--process-hosts",
         *([] if plugin else ["--no-plugin"]), "--state-dir", str(state_dir)], stdout=log,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, **(env or {})})
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


def deploy_echo(url: str, auth: tuple[str, str], name: str, labels: dict[str, str] | None = None) -> str:
    """Deploy ``quart/echo`` as ``name`` (with ``labels``) and wait for its replica; the replica's URL."""
    res = requests.post(f"{url}/system/functions", auth=auth, timeout=30,
                        json={"service": name, "image": "quart/echo:latest", "labels": labels or {}})
    res.raise_for_status()
    deadline = time.monotonic() + 60
    while True:
        listing = requests.get(f"{url}/system/replicas/{name}", auth=auth, timeout=10).json()
        ready = [r for r in listing["replicas"] if r["state"] == "ready"]
        if ready:
            return ready[0]["url"]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} replica not ready in 60 s")
        time.sleep(0.05)


def _throughput_pair(client: str, tmp: Path, url: str, replica_url: str, body: bytes, connections: int,
                     seconds: float) -> dict:
    """Closed-loop req/s through the gateway and directly (and, from wrk, latency under that load)."""
    if client == "python":
        rps_gateway = asyncio.run(_throughput(url, "/function/echo", body, connections, seconds))
        rps_direct = asyncio.run(_throughput(replica_url, "/", body, connections, seconds))
        return {"rps_gateway": round(rps_gateway, 1), "rps_direct": round(rps_direct, 1)}
    script = write_script(tmp, len(body))
    run_wrk(client, f"{url}/function/echo", script, connections, 1)  # warm the gateway's upstream pool
    gateway = run_wrk(client, f"{url}/function/echo", script, connections, seconds)
    direct = run_wrk(client, f"{replica_url}/", script, connections, seconds)
    return {
        "rps_gateway": round(gateway.rps, 1), "rps_direct": round(direct.rps, 1),
        "loaded": {"p50_gateway_ms": gateway.p50_ms, "p99_gateway_ms": gateway.p99_ms,
                   "p50_direct_ms": direct.p50_ms, "p99_direct_ms": direct.p99_ms,
                   "p50_added_ms": round(gateway.p50_ms - direct.p50_ms, 3),
                   "p99_added_ms": round(gateway.p99_ms - direct.p99_ms, 3)},
    }


def run(body_bytes: int, count: int, warmup: int, connections: int, seconds: float, client: str = "auto") -> dict:
    """The whole bench; ``client``: ``auto`` (wrk if found or installable, else python), ``wrk`` or ``python``."""
    client, client_name = choose_client(client)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="quart-bench-gw-") as tmp:
        process, url, auth = _start_gateway(Path(tmp))
        try:
            replica_url = deploy_echo(url, auth, "echo")
            body = os.urandom(body_bytes)
            try:
                import uvloop

                uvloop.install()
            except ImportError:  # pragma: no cover
                pass
            latency = asyncio.run(_latency(url, replica_url, body, count, warmup))
            loaded = _throughput_pair(client, Path(tmp), url, replica_url, body, connections, seconds)
        finally:
            stop_process(process.pid, process)
    rps_gateway, rps_direct = loaded["rps_gateway"], loaded["rps_direct"]
    return {
        "connections": connections, "rps_direct": rps_direct, "rps_gateway": rps_gateway,
        "ratio_gateway_vs_direct": round(rps_gateway / rps_direct, 3) if rps_direct else None,
        **{k: round(v, 4) for k, v in latency.items()},
        **({"loaded": loaded["loaded"]} if "loaded" in loaded else {}),
        "latency_requests": count, **run_facts(client_name, body_bytes, seconds, load_start),
    }


def choose_client(client: str) -> tuple[str, str]:
    """The throughput client to run (wrk's path or ``python``) and its name, for ``auto``, ``wrk`` or ``python``."""
    if client != "python":
        wrk = find_wrk(install=True)
        if wrk is None and client == "wrk":
            raise RuntimeError("wrk is not installed (apt-get install wrk) and could not be installed")
        client = wrk or "python"
    return client, version(client) if client != "python" else "quart asyncio client (tools/bench/gateway.py)"


def run_facts(client_name: str, body_bytes: int, seconds: float, load_start: tuple[float, ...]) -> dict:
    """What a run's JSON says of its conditions: client, body, duration, replica, machine and load."""
    return {"client": client_name, "body_bytes": body_bytes, "seconds": seconds,
            "replica": "built-in quart/echo (raw asyncio HTTP/1.1 echo, uvloop)",
            "machine": {**machine_info(), "loadavg_start": [round(x, 2) for x in load_start],
                        "loadavg_end": [round(x, 2) for x in os.getloadavg()]}}


def add_load_args(p: argparse.ArgumentParser) -> None:
    """--out, --body-bytes, --connections, --seconds, --client: shared by the gateway and pipeline benches."""
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout)")
    p.add_argument("--body-bytes", type=int, default=1024)
    p.add_argument("--connections", "--concurrency", type=int, default=16, dest="connections",
                   help="keep-alive connections in the closed-loop throughput runs")
    p.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run (wrk: whole seconds)")
    p.add_argument("--client", choices=("auto", "wrk", "python"), default="auto",
                   help="throughput client: wrk (found, or apt-get installed when root), our asyncio client, or "
                        "auto (wrk when it can be had)")


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench gateway", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000, help="latency pairs measured (after warm-up)")
    p.add_argument("--warmup", type=int, default=300)
    add_load_args(p)
    args = p.parse_args(argv)
    result = run(args.body_bytes, args.requests, args.warmup, args.connections, args.seconds, args.client)
    write_report(result, args.out, always_print=True)
    return 0
