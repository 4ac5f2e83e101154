"""`quartctl bench chaos` generation faults (issue 31, item 7): concurrent token streams through a `quartctl up`
gateway while a stage replica, a KeysManager or the gateway itself is killed.

The ``tiny`` decoder (real CPU compute, random weights) at 3 stages, 2 replicas per stage on 2 KeysManager
hosts. An undisturbed run of ``--streams`` concurrent greedy streams (distinct prompts, ``ignore_eos``) gives
each prompt's reference tokens; each scenario then opens the same streams again and injects its fault once
every stream has a few tokens:

- ``stream-replica-kill``: kill -9 one stage-1 replica that holds sessions (failover by replay: the streams
  go on, their tokens identical);
- ``stream-keysmanager-kill``: kill -9 one host's KeysManager;
- ``stream-gateway-restart``: SIGTERM the gateway with the streams open (it drains them), `quartctl up` again;
- ``stream-gateway-kill``: kill -9 the gateway with the streams open, `quartctl up` again (the open streams
  end: the client sees its connection closed, an error, never a hang).

Per scenario: ``streams_started``, ``streams_completed`` (``[DONE]`` after a ``finish_reason`` event and
every token), ``streams_identical`` (completed with the reference's tokens), ``stream_errors`` (an HTTP
error, an error event, or the connection closed before ``[DONE]``: the client knows; ``stream_closed`` of
them ended without an error event), ``stream_hangs`` (neither within ``--stream-timeout``).
Targets: completed + errors = started, hangs 0, identical = completed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import aiohttp
import psutil
from quart_tools.bench.chaos_system import Gateway, wait_serving

STREAM_SCENARIOS = ("stream-replica-kill", "stream-keysmanager-kill", "stream-gateway-restart", "stream-gateway-kill")
STREAM_MODEL = "tiny"
TOKENS_BEFORE_FAULT = 3  # every stream has this many tokens when the fault is injected


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(6)] for _ in range(count)]


async def one_stream(session: aiohttp.ClientSession, url: str, ids: list[int], new_tokens: int, timeout_s: float,
                     progress: list[int], index: int) -> dict:
    """One greedy stream on ``POST /function/<model>``: ``outcome`` completed, error or hang; its tokens;
    ``progress[index]`` counts them as they come."""
    body = {"input_ids": ids, "max_tokens": new_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    out: dict = {"outcome": "hang", "tokens": [], "error": None, "closed": False}
    finished = False
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/function/{STREAM_MODEL}", json=body) as res:
                if res.status != 200:
                    out.update(outcome="error", error=f"HTTP {res.status}: {(await res.text())[:200]}")
                    return out
                async for raw in res.content:
                    line = raw.decode().strip()
                    if line == "data: [DONE]":
                        complete = finished and out["error"] is None and len(out["tokens"]) == new_tokens
                        out["outcome"] = "completed" if complete else "error"
                        return out
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = str(event["error"])[:200]
                    elif event.get("token") is not None:
                        out["tokens"].append(event["token"])
                        progress[index] += 1
                    elif "finish_reason" in event:
                        finished = True
                out.update(outcome="error", closed=True)  # the connection ended without [DONE]
                out["error"] = out["error"] or "connection closed before [DONE]"
    except TimeoutError:
        out["outcome"] = "hang"
    except aiohttp.ClientError as exc:  # reset, refused, closed mid-body: the client knows
        out.update(outcome="error", closed=True, error=f"{type(exc).__name__}: {exc}"[:200])
    return out


async def run_streams(url: str, ids: list[list[int]], new_tokens: int, timeout_s: float,
                      fault=None) -> tuple[list[dict], dict]:
    """Every prompt as one concurrent stream; ``fault()`` (a coroutine function) awaited once every stream has
    :data:`TOKENS_BEFORE_FAULT` tokens (or any stream ended, or ``timeout_s`` / 2 passed); its result returned."""
    progress = [0] * len(ids)
    injected: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(one_stream(session, url, p, new_tokens, timeout_s, progress, i))
                 for i, p in enumerate(ids)]
        if fault is not None:
            deadline = time.monotonic() + timeout_s / 2
            while (min(progress) < TOKENS_BEFORE_FAULT and not any(t.done() for t in tasks)
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.01)
            injected = {"tokens_at_fault": sum(progress), **(await fault())}
        results = await asyncio.gather(*tasks)
    return results, injected


def summary(name: str, results: list[dict], refs: list[list[int]], injected: dict) -> dict:
    by = {k: sum(1 for r in results if r["outcome"] == k) for k in ("completed", "error", "hang")}
    errors = sorted({r["error"] for r in results if r["error"]})
    return {"name": name, "streams_started": len(results), "streams_completed": by["completed"],
            "streams_identical": sum(1 for r, ref in zip(results, refs, strict=True)
                                     if r["outcome"] == "completed" and r["tokens"] == ref),
            "stream_errors": by["error"], "stream_closed": sum(1 for r in results if r["closed"]),
            "stream_hangs": by["hang"], "error_kinds": errors[:5], **injected}


async def _session_replicas(session: aiohttp.ClientSession, gw: Gateway) -> set[str]:
    async with session.get(f"{gw.url}/function/quart-plugin/sessions", auth=gw.auth) as r:
        return {rep for s in (await r.json())["active"] for rep in s["replicas"] if rep}


async def _kill_stage_replica(gw: Gateway, rng: random.Random) -> dict:
    """kill -9 a ready ``tiny-stage-1`` replica that holds sessions (any ready one when none is seen)."""
    fn = f"{STREAM_MODEL}-stage-1"
    async with aiohttp.ClientSession() as session:
        held = await _session_replicas(session, gw)
        async with session.get(f"{gw.url}/system/replicas/{fn}", auth=gw.auth) as r:
            ready = [rep for rep in (await r.json())["replicas"] if rep["state"] == "ready"]
    victim = rng.choice([rep for rep in ready if rep.get("id") in held] or ready)
    port = int(victim["url"].rsplit(":", 1)[1])
    pid = next(c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
    os.kill(pid, signal.SIGKILL)
    return {"killed": "replica", "killed_replica": victim.get("id"), "killed_pid": pid,
            "sessions_on_it": victim.get("id") in held}


async def _kill_keysmanager(gw: Gateway, rng: random.Random) -> dict:
    pid = rng.choice([h["pid"] for h in gw.state()["hosts"]])
    os.kill(pid, signal.SIGKILL)
    return {"killed": "keysmanager", "killed_pid": pid}


async def _restart_gateway(gw: Gateway, rng: random.Random) -> dict:
    started = time.monotonic()
    await asyncio.to_thread(gw.stop)  # SIGTERM with the streams open
    return {"killed": "gateway", "stop_s": round(time.monotonic() - started, 2)}


async def _kill_gateway(gw: Gateway, rng: random.Random) -> dict:
    pid = gw.process.pid
    os.kill(pid, signal.SIGKILL)  # no drain: the open streams' connections close under them
    await asyncio.to_thread(gw.process.wait)
    gw.process = None
    return {"killed": "gateway", "killed_pid": pid}


FAULTS = {"stream-replica-kill": _kill_stage_replica, "stream-keysmanager-kill": _kill_keysmanager,
          "stream-gateway-restart": _restart_gateway, "stream-gateway-kill": _kill_gateway}


def tiny_stack(folder: Path) -> Path:
    from quart_tools.partition import partition

    partition(STREAM_MODEL, 3, str(folder), progress=False,
              stack={"compute": "cpu", "scale_min": 2, "scale_max": 2})
    return folder / "stack.yml"


async def stream_scenarios(tmp: Path, names: list[str], streams: int, new_tokens: int, timeout_s: float,
                           seed: int) -> list[dict]:
    """Every stream scenario of ``names`` on its own gateway (the ``tiny`` decoder, 2 hosts)."""
    stack = tiny_stack(tmp / "tiny")
    state = tmp / "stream-state"
    state.mkdir()
    gw = Gateway(state, ["--hosts", "2", "--gpus-per-host", "4", "-f", str(stack)])
    await asyncio.to_thread(gw.start, 300.0)
    out = []
    try:
        async with aiohttp.ClientSession() as session:
            if await wait_serving(session, gw, 300, want=3) == float("inf"):
                raise RuntimeError("the tiny decoder never served at its desired replicas")
        ids = prompts(streams, seed)
        reference, _ = await run_streams(gw.url, ids, new_tokens, timeout_s)
        if any(r["outcome"] != "completed" for r in reference):
            raise RuntimeError(f"the undisturbed run failed: {[r['error'] for r in reference if r['error']]}")
        refs = [r["tokens"] for r in reference]
        for i, name in enumerate(names):
            rng = random.Random(seed + i)
            results, injected = await run_streams(gw.url, ids, new_tokens, timeout_s,
                                                  lambda fault=FAULTS[name], rng=rng: fault(gw, rng))
            if not gw.alive():
                await asyncio.to_thread(gw.start, 120.0)
            async with aiohttp.ClientSession() as session:
                serving = await wait_serving(session, gw, 120.0, want=3)
            out.append({**summary(name, results, refs, injected), "serving_again": serving != float("inf")})
    finally:
        await asyncio.to_thread(gw.down)
    return out
