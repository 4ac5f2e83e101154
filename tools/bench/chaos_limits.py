"""Bounds and deadlines under attack, for `quartctl bench chaos` (issue 31's acceptance).

- :func:`oversized_text`: a 4 MB ``text`` to the model's pipeline: its answer (413 naming
  ``QUART_MAX_TEXT_CHARS``) and the growth of the stage-0 replicas' RSS while it is handled.
- :func:`async_32mb`: a 32 MiB ``/async-function`` body: 202 (or 413 over the configured limit), never 429; the
  gateway's RSS growth until the 202 (the body's ingest; the queue worker's call that follows is not counted).
- :func:`deadline_summary`, of ``chaos.overload_deadline`` (a gateway serving the model with a slower emulated
  service time, its :func:`capacity` measured closed-loop, then an open loop at ``factor`` × capacity with
  ``X-Quart-Timeout-Ms``): ``admitted``:
  calls not refused at entry (a 429 without ``X-Quart-Shed``, or a 400); ``within_deadline``: admitted calls
  answered (2xx, or a 429 shed from their queue) within the deadline as the client measures it (from its
  headers sent); a 504, a lost call or a late answer is not. The gateway's RSS growth is sampled throughout.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import psutil

TEXT_CHARS = 4 << 20  # the 4 MB body


async def peak_rss(pids: list[int], stop: asyncio.Event) -> int:
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


async def _measured(pids: list[int], call, settle_s: float = 0.3) -> tuple[object, float]:
    """``await call()`` while sampling the RSS of ``pids``, and ``settle_s`` after it (what a replica still
    allocates after answering): (its result, the peak growth in MB)."""
    procs = [psutil.Process(p) for p in pids]
    before = sum(p.memory_info().rss for p in procs)
    stop = asyncio.Event()
    sampler = asyncio.create_task(peak_rss(pids, stop))
    try:
        result = await call()
        await asyncio.sleep(settle_s)
    finally:
        stop.set()
    return result, round(max(0, await sampler - before) / 2**20, 1)


async def oversized_text(gw, model: str, pids: list[int]) -> dict:
    """A 4 MB text to ``model``'s pipeline while the RSS of ``pids`` (its stage-0 replicas) is sampled."""
    async with aiohttp.ClientSession() as session:
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

        (status, text), growth = await _measured([pid], post, settle_s=0.0)  # the ingest, not the call it makes
    return {"status": status, "gateway_rss_growth_mb": growth, "answer": text}


async def capacity(gw, path: str, body: bytes, headers: dict[str, str], seconds: float = 4.0,
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


def deadline_summary(answers: list[tuple[int, float, bool]], sent: int, lost: int, deadline_ms: int) -> dict:
    """``admitted`` (not refused at entry), ``within_deadline`` (answered 2xx or shed within it), ``shed``."""
    refused = sum(1 for status, _, shed in answers if status == 400 or (status == 429 and not shed))
    within = [status for status, ms, shed in answers
              if ms <= deadline_ms and (200 <= status < 300 or (status == 429 and shed))]
    return {"sent": sent, "refused_at_entry": refused, "admitted": sent - refused, "within_deadline": len(within),
            "ok_within": sum(1 for status in within if status < 300), "shed": sum(1 for *_, shed in answers if shed),
            "lost": lost}
