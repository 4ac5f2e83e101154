"""`quartctl bench peer-cpu`: the CPU a chain hop spends per byte, on the real peer path over loopback TCP.

One source KeysManager-side server (``keysmanager.peers.serve_file`` over a complete file) → a middle hop
(``stream_from_peer`` into a ``VerifiedWriter``, serving the file on while it grows, as a multicast chain
does) → a tail hop (``stream_from_peer``). Each role is its own process; each reports its CPU seconds
(``getrusage``, user + system) per GB for the transfer. The middle hop also reports its receiving thread's CPU
alone (``time.thread_time``), so ``mid_forward`` = its process total minus that.

``--receive`` picks the receiving path of ``stream_from_peer`` (``keysmanager.peers.RECEIVE_PATHS``) and
``--landing`` whether the hops land in a landing reserve (``keysmanager.landing``: pages touched before the
transfer, outside the CPU counted) or in fresh pages; with several, the runs alternate and each variant's median
is reported (``copy``, ``copy+landing``, ...), all in one run on the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from aiohttp import web
from quart_tools.bench import write_random_file

from keysmanager.landing import LandingReserve
from keysmanager.peers import RECEIVE_PATHS, StageFile, serve_file, stream_from_peer
from keysmanager.transfer import VerifiedWriter


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def serve_stage(stage: StageFile, middlewares: tuple = ()) -> tuple[web.AppRunner, int]:
    """``stage`` served on ``GET /v1/stages/{function}/file`` at an ephemeral loopback port: (runner, port)."""
    app = web.Application(middlewares=middlewares)
    app.router.add_get("/v1/stages/{function}/file", lambda request: serve_file(request, stage))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site.port


def _source(path: str, sha: str, size: int, ports, done) -> None:
    async def main() -> None:
        runner, port = await serve_stage(StageFile("f", Path(path), sha, size))
        ports.put(port)
        c0 = _cpu()
        await asyncio.to_thread(done.wait, 600)
        ports.put(("source", _cpu() - c0, 0.0))
        await runner.cleanup()
    asyncio.run(main())


def _landing(dest: str, size: int, landing: bool) -> LandingReserve | None:
    """A landing reserve beside ``dest``, filled (touched) before any CPU is counted; None without ``landing``."""
    if not landing:
        return None
    reserve = LandingReserve(Path(dest).with_name(Path(dest).name + ".landing"), size)
    reserve.start()
    while reserve.state == "filling":
        time.sleep(0.01)
    return reserve


def _mid(upstream: int, dest: str, sha: str, size: int, receive: str, landing: bool, ports, done) -> None:
    writer = VerifiedWriter(Path(dest), sha, size, landing=_landing(dest, size, landing)).__enter__()
    stage = StageFile("f", writer.dest, sha, size, writer)

    async def main() -> None:
        runner, port = await serve_stage(stage)
        ports.put(port)
        c0, t0, box = _cpu(), time.perf_counter(), {}

        def fetch() -> None:
            start = time.thread_time()
            box["result"] = stream_from_peer(f"http://127.0.0.1:{upstream}", "f", None, writer, receive=receive)
            box["thread_cpu"] = time.thread_time() - start

        thread = threading.Thread(target=fetch, daemon=True)
        thread.start()
        await asyncio.to_thread(thread.join, 600)
        wall = time.perf_counter() - t0
        await asyncio.to_thread(done.wait, 600)  # the tail has its last byte: the forwarding is over
        ports.put(("mid", _cpu() - c0, wall, box["thread_cpu"]))
        await runner.cleanup()
    asyncio.run(main())


def _tail(upstream: int, dest: str, sha: str, size: int, receive: str, landing: bool, ports) -> None:
    reserve = _landing(dest, size, landing)
    c0, t0 = _cpu(), time.perf_counter()
    with VerifiedWriter(Path(dest), sha, size, landing=reserve) as writer:
        stream_from_peer(f"http://127.0.0.1:{upstream}", "f", None, writer, receive=receive)
    ports.put(("tail", _cpu() - c0, time.perf_counter() - t0))


def run_once(folder: Path, source: Path, sha: str, size: int, receive: str, landing: bool = False) -> dict:
    """One source → mid → tail transfer; CPU seconds per GB of each role and the chain's wall time. ``landing``:
    both hops land in a landing reserve."""
    ctx = multiprocessing.get_context("fork")
    q, done = ctx.Queue(), ctx.Event()
    for name in ("mid.bin", "tail.bin"):
        (folder / name).unlink(missing_ok=True)
    procs = [ctx.Process(target=_source, args=(str(source), sha, size, q, done))]
    procs[0].start()
    src_port = q.get(timeout=60)
    procs.append(ctx.Process(target=_mid, args=(src_port, str(folder / "mid.bin"), sha, size, receive, landing, q, done)))
    procs[1].start()
    mid_port = q.get(timeout=60)
    t0 = time.perf_counter()
    procs.append(ctx.Process(target=_tail, args=(mid_port, str(folder / "tail.bin"), sha, size, receive, landing, q)))
    procs[2].start()
    got = {}
    first = q.get(timeout=60 + size / 20e6)  # the tail finishes first: then the others may stop
    got[first[0]] = first
    chain_wall = time.perf_counter() - t0
    done.set()
    for _ in range(2):
        item = q.get(timeout=60)
        got[item[0]] = item
    for p in procs:
        p.join(30)
    gb = size / 1e9
    mid = got["mid"]
    return {"receive": receive + ("+landing" if landing else ""), "chain_wall_s": round(chain_wall, 3),
            "mid_receive_cpu_s_per_gb": round(mid[3] / gb, 3), "mid_total_cpu_s_per_gb": round(mid[1] / gb, 3),
            "mid_forward_cpu_s_per_gb": round((mid[1] - mid[3]) / gb, 3),
            "tail_cpu_s_per_gb": round(got["tail"][1] / gb, 3), "source_cpu_s_per_gb": round(got["source"][1] / gb, 3),
            "verified": (folder / "tail.bin").exists() and (folder / "mid.bin").exists()}


def floor_components(folder: Path, nbytes: int = 256 << 20) -> dict:
    """CPU seconds per GB of the two per-byte costs no receive path avoids: sha256 over bytes in memory, and
    writing bytes into fresh tmpfs pages (allocate, zero, copy); and, beside them, into pages already there."""
    block, gb = os.urandom(1 << 20), nbytes / 1e9
    c0, digest = _cpu(), hashlib.sha256()
    for _ in range(nbytes >> 20):
        digest.update(block)
    c1 = _cpu()
    target = folder / "floor.bin"
    with open(target, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
    c2 = _cpu()
    with open(target, "r+b") as f:  # the same pages again: what a landing reserve leaves (the copy alone)
        for _ in range(nbytes >> 20):
            f.write(block)
    c3 = _cpu()
    target.unlink()
    return {"sha256_cpu_s_per_gb": round((c1 - c0) / gb, 3), "tmpfs_write_cpu_s_per_gb": round((c2 - c1) / gb, 3),
            "tmpfs_overwrite_cpu_s_per_gb": round((c3 - c2) / gb, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quartctl bench peer-cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="stage file size in MB (default 512)")
    parser.add_argument("--runs", type=int, default=3, help="runs per receive path (alternating)")
    parser.add_argument("--receive", default=",".join(RECEIVE_PATHS),
                        help=f"receive paths to compare, comma-separated (of {', '.join(RECEIVE_PATHS)})")
    parser.add_argument("--landing", default="off,on",
                        help="land in fresh pages (off), in a landing reserve (on), or both alternating (default)")
    parser.add_argument("--dir", default="/dev/shm", help="where the files go (tmpfs, as a KeysManager's state)")
    parser.add_argument("--out", help="write the JSON here (default stdout)")
    args = parser.parse_args(argv)
    paths = [p for p in args.receive.split(",") if p]
    unknown = [p for p in paths if p not in RECEIVE_PATHS]
    if unknown:
        parser.error(f"--receive: unknown path(s) {unknown}; known: {list(RECEIVE_PATHS)}")
    landings = [x == "on" for x in args.landing.split(",") if x]
    if not landings or any(x not in ("on", "off") for x in args.landing.split(",") if x):
        parser.error(f"--landing: expected off, on or off,on; got {args.landing!r}")
    variants = [(p, landing) for landing in landings for p in paths]
    load_before = os.getloadavg()
    folder = Path(tempfile.mkdtemp(prefix="quart-peer-cpu-", dir=args.dir))
    try:
        floor = floor_components(folder)
        size = args.mb << 20
        source = folder / "source.bin"
        sha = write_random_file(source, size)
        runs = [run_once(folder, source, sha, size, p, landing) for _ in range(args.runs) for p, landing in variants]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    keys = ("chain_wall_s", "mid_receive_cpu_s_per_gb", "mid_forward_cpu_s_per_gb", "mid_total_cpu_s_per_gb",
            "tail_cpu_s_per_gb", "source_cpu_s_per_gb")
    medians = {name: {k: round(statistics.median(r[k] for r in runs if r["receive"] == name), 3) for k in keys}
               for name in dict.fromkeys(r["receive"] for r in runs)}
    doc = {"bench": "peer-cpu", "mb": args.mb, "runs": args.runs, "load_before": [round(x, 2) for x in load_before],
           "medians": medians, "floor": floor, "all": runs, "load_after": [round(x, 2) for x in os.getloadavg()]}
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if not args.out else json.dumps({"medians": medians, "floor": floor}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
