"""Bounds and deadlines under attack, for `quartctl bench chaos` (issue 31's acceptance).

- :func:`oversized_text`: a 4 MB ``text`` to the model's pipeline: its answer (413 naming
  ``QUART_MAX_TEXT_CHARS``) and the growth of the stage-0 replicas' RSS while it is handled.
- :func:`async_32mb`: a 32 MiB ``/async-function`` body: 202 (or 413 over the configured limit), never 429.
- :func:`overload_deadline`: a gateway serving the model with a slower emulated service time, its capacity
  measured closed-loop, then an open loop at ``factor`` × capacity with ``X-Quart-Timeout-Ms``. ``admitted``:
  calls not refused at entry (a 429 without ``X-Quart-Shed``, or a 400); ``within_deadline``: admitted calls
  answered (2xx, or a 429 shed from their queue) within the deadline as the client measures it (from its
  headers sent); a 504, a lost call or a late answer is not. The gateway's RSS growth is sampled throughout.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp
import psutil

TEXT_CHARS = 4 << 20  # the 4 MB body


async def _peak_rss(pids: list[int], stop: asyncio.Event) -> int:
    """The largest summed RSS of ``pids`` until ``stop`` (sampled every 20 ms)."""
    procs = [psutil.Process(p) for p in pids]
    peak = 0
    while not stop.is_set():
        try:
            peak = max(peak, sum(p.memory_info().rss for p in procs))
        except psutil.Error:
            pass
        await asyncio.sleep(0.02)
    return peak


async def _measured(pids: list[int], call) -> tuple[object, float]:
    """``await call()`` while sampling the RSS of ``pids``: (its result, the peak growth in MB)."""
    procs = [psutil.Process(p) for p in pids]
    before = sum(p.memory_info().rss for p in procs)
    stop = asyncio.Event()
    sampler = asyncio.create_task(_peak_rss(pids, stop))
    try:
        result = await call()
        await asyncio.sleep(0.3)  # what the replica still allocates after answering
    finally:
        stop.set()
    return result, round(max(0, await sampler - before) / 2**20, 1)


async def oversized_text(gw, model: str) -> dict:
    from quart_tools.bench.chaos import _replica_pids

    async with aiohttp.ClientSession() as session:
        pids = await _replica_pids(session, gw, f"{model}-stage-0")
        body = json.dumps({"text": "a " * (TEXT_CHARS // 2)}).encode()

        async def post() -> tuple[int, str]:
            async with session.post(f"{gw.url}/function/{model}", data=body,
                                    headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=120)) as r:
                return r.status, (await r.text())[:200]

        (status, text), growth = await _measured(pids, post)
    return {"status": status, "replica_rss_growth_mb": growth, "text_chars": TEXT_CHARS, "replicas": len(pids),
            "answer": text}


async def async_32mb(gw, model: str) -> dict:
    async with aiohttp.ClientSession() as session:
        pid = gw.process.pid
        body = os.urandom(32 << 20)

        async def post() -> tuple[int, str]:
            async with session.post(f"{gw.url}/async-function/{model}", data=body,
                                    timeout=aiohttp.ClientTimeout(total=120)) as r:
                return r.status, (await r.text())[:200]

        (status, text), growth = await _measured([pid], post)
    return {"status": status, "gateway_rss_growth_mb": growth, "answer": text}


async def _capacity(gw, path: str, body: bytes, headers: dict[str, str], seconds: float = 4.0,
                    workers: int = 16) -> float:
    """Requests per second answered 2xx by a closed loop of ``workers``."""
    done = 0
    async with aiohttp.ClientSession() as session:
        end = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                async with session.post(gw.url + path, data=body, headers=headers) as r:
                    await r.read()
                    done += 200 <= r.status < 300
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(workers)))
    return done / (time.monotonic() - start)


async def overload_deadline(tmp: Path, factor: float, seconds: float, deadline_ms: int, mean_ms: float) -> dict:
    from quart_tools.bench.chaos import BODY, MODEL, Gateway, _stack, open_loop, wait_serving

    stack = _stack(tmp / "deadline-model", mean_ms, concurrency=1)
    state = tmp / "deadline-state"
    state.mkdir()
    gw = Gateway(state, ["--hosts", "1", "--gpus-per-host", "8", "--no-keep-hosts", "-f", str(stack)])
    await asyncio.to_thread(gw.start, 300.0)
    try:
        async with aiohttp.ClientSession() as session:
            if await wait_serving(session, gw, 300, want=3) == float("inf"):
                raise RuntimeError("the overload model never served")
        headers = {"Content-Type": "application/json"}
        capacity = await _capacity(gw, f"/function/{MODEL}", BODY, headers)
        proc = psutil.Process(gw.process.pid)
        base = proc.memory_info().rss
        stop = asyncio.Event()
        sampler = asyncio.create_task(_peak_rss([gw.process.pid], stop))
        answers: list[tuple[int, float, bool]] = []
        result = await open_loop(gw, f"/function/{MODEL}", BODY, capacity * factor, seconds,
                                 timeout_s=deadline_ms / 1000 + 30,
                                 headers={**headers, "X-Quart-Timeout-Ms": str(deadline_ms)}, answers=answers)
        stop.set()
        peak = await sampler
    finally:
        await asyncio.to_thread(gw.down)
    refused = sum(1 for status, _, shed in answers if status == 400 or (status == 429 and not shed))
    within = [(status, ms) for status, ms, shed in answers
              if ms <= deadline_ms and (200 <= status < 300 or (status == 429 and shed))]
    return {"factor": factor, "capacity_rps": round(capacity, 1), "mean_ms": mean_ms, "deadline_ms": deadline_ms,
            "sent": result["sent"], "refused_at_entry": refused, "admitted": result["sent"] - refused,
            "within_deadline": len(within), "ok_within": sum(1 for status, _ in within if status < 300),
            "shed": sum(1 for _, _, shed in answers if shed), "lost": result["lost"],
            "rss_growth_mb": round(max(0, peak - base) / 2**20, 1), "by_status": result["by_status"]}
