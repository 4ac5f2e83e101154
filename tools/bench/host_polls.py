"""`quartctl bench host-polls`: how late a KeysManager busy with bursts of starts answers the gateway's polls.

The gateway polls every host each ``reconcile_interval_s`` (0.2 s), each poll bounded by ``host_timeout_s``
(0.5 s); a host is down after ``host_down_polls`` polls in a row go unanswered (and ``host_down_after_s`` of
silence). This measures what that threshold must ride out: one KeysManager daemon, a stage of ``--mb`` MB
(emulated compute), ``--rounds`` bursts of ``--replicas`` starts at once (as a scale-up places them: the first
round also loads the zygote) then as many stops at once, while a poller asks for the replica list as the
reconciler does; ``--hogs N`` adds N processes spinning on the CPUs meanwhile (a saturated machine, as under a
live bench's load). It reports each poll's answer time, the polls missed, the longest run of misses, and for each
candidate threshold how many times the host would have been marked down (every one a false alarm: the
KeysManager never stopped).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quart_stage import cliargs
from quart_tools.bench import machine_info, write_report
from quart_tools.bench.keysmanager import Daemon, _spec, make_stage

from keysmanager.aio import within
from keysmanager.client import AsyncKeysManagerClient


async def _poll(client: AsyncKeysManagerClient, interval_s: float, timeout_s: float, stop: asyncio.Event
                ) -> list[float | None]:
    """The reconciler's poll: the answer time of each, None for a miss (no answer within ``timeout_s``)."""
    out: list[float | None] = []
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            await within(timeout_s, client.replicas(memory=False))
            out.append(time.monotonic() - t0)
        except Exception:
            out.append(None)
        await asyncio.sleep(interval_s)
    return out


async def _bursts(client: AsyncKeysManagerClient, spec, replicas: int, rounds: int) -> list[dict]:
    rows = []
    for _ in range(rounds):
        t0 = time.monotonic()
        await client.ensure_cached(spec)
        started = await asyncio.gather(*(client.start(spec, 1, wait=False, survive=True) for _ in range(replicas)))
        ids = [r.id for batch in started for r in batch]
        while sum(r.state == "ready" for r in await client.replicas(memory=False) if r.id in ids) < len(ids):
            await asyncio.sleep(0.05)
        ready_s = time.monotonic() - t0
        await asyncio.gather(*(client.stop(rid) for rid in ids))
        rows.append({"ready_s": round(ready_s, 2), "round_s": round(time.monotonic() - t0, 2)})
    return rows


def _streaks(polls: list[float | None]) -> list[int]:
    runs, n = [], 0
    for p in [*polls, 0.0]:
        if p is None:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


async def measure(socket: Path, spec, args) -> dict:
    client = AsyncKeysManagerClient(str(socket), timeout=600)
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll(client, args.interval, args.timeout, stop))
    try:
        rounds = await _bursts(client, spec, args.replicas, args.rounds)
    finally:
        stop.set()
        polls = await poller
        await client.close()
    answered = sorted(p for p in polls if p is not None)
    streaks = _streaks(polls)
    return {"rounds": rounds, "polls": len(polls), "missed": len(polls) - len(answered),
            "answer_ms": {"median": round(1e3 * statistics.median(answered), 1) if answered else None,
                          "p99": round(1e3 * answered[int(0.99 * (len(answered) - 1))], 1) if answered else None,
                          "max": round(1e3 * answered[-1], 1) if answered else None},
            "miss_streaks": streaks, "longest_streak": max(streaks, default=0),
            "false_downs": {str(n): sum(1 for s in streaks if s >= n) for n in (1, 2, 3)}}


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench host-polls", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON here (default stdout)")
    p.add_argument("--mb", type=int, default=50, help="stage size in MB (default 50)")
    p.add_argument("--replicas", type=int, default=16, help="starts per burst, at once (default 16)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--interval", type=float, default=0.2, help="poll period, s (reconcile_interval_s)")
    p.add_argument("--timeout", type=float, default=0.5, help="one poll's bound, s (host_timeout_s)")
    p.add_argument("--hogs", type=int, default=0, help="processes spinning on the CPUs during the bursts")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="km-polls-"))
    load_before = os.getloadavg()
    hogs: list[subprocess.Popen] = []
    try:
        model, _nbytes = make_stage(root, args.mb)
        daemon = Daemon(root, ("--gpus", str(args.replicas)))
        try:
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
            doc = asyncio.run(measure(daemon.socket, _spec("polls", model, "emulated"), args))
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
            daemon.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc = {"benchmark": "host-polls", "stage_mb": args.mb, "replicas": args.replicas, "interval_s": args.interval,
           "timeout_s": args.timeout, "hogs": args.hogs, **doc,
           "machine": machine_info(loadavg_before=[round(x, 2) for x in load_before],
                                   loadavg_after=[round(x, 2) for x in os.getloadavg()])}
    write_report(doc, args.out)
    print(f"polls {doc['polls']}, missed {doc['missed']}, longest run {doc['longest_streak']}; false downs by "
          f"threshold {doc['false_downs']}", file=sys.stderr)
    return 0
