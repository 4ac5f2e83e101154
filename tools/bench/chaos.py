"""`quartctl bench chaos`: faults, overload and fuzzing against a real `quartctl up` (issue 14's acceptance).

- **Scenarios** (2 hosts with KeysManagers, an emulated 3-stage model at 2 replicas per stage, an open loop of
  ``--rate`` req/s on ``POST /function/<model>`` for ``--seconds`` each): ``replica-kill`` (kill -9 a random
  replica every 3 s), ``keysmanager-kill`` (kill -9 one KeysManager), ``replica-stop`` (SIGSTOP a replica
  for 5 s), ``gateway-restart`` (SIGTERM the gateway, `quartctl up` again on the same state folder: the
  functions come back from the store, the replicas the kept hosts still run are adopted; ``recovered_s``
  counts from the new process's start, its imports included), ``gateway-restart-default`` (the same with no
  flag at all: kept hosts are the default on loopback, issue 31). Per scenario: ``sent``, ``ok`` (2xx),
  ``explicit_error`` (an HTTP error or a refused connection: the client knows), ``lost`` (no answer within the client's timeout),
  ``recovered_s`` (from the last fault to every function at its desired replicas again).
- **Stream scenarios** (issue 31, :mod:`.chaos_streams`): ``--streams`` concurrent token streams of the ``tiny``
  decoder on their own gateway while a stage replica, a KeysManager or the gateway is killed (or restarted):
  ``streams_started``, ``streams_completed``, ``streams_identical``, ``stream_errors``, ``stream_hangs``.
- **Overload** (`--process-hosts`, ``quart/echo`` at concurrency 1 on one replica, 32 MB bodies): the
  capacity measured closed-loop, then an open loop at ``--factor`` × capacity with a deadline
  (``X-Quart-Timeout-Ms``): the gateway's RSS growth and the p99 of accepted requests.
- **Limits** (issue 31, :mod:`.chaos_limits`): ``oversized_text`` (a 4 MB text: 413, replica RSS growth),
  ``async_32mb`` (202, never 429), ``overload_deadline`` (``--deadline-factor`` × the capacity of the model at
  ``--deadline-mean-ms`` per stage, with ``--deadline-ms``: admitted calls answered within their deadline).
- **Fuzz** (``--fuzz-cases``, seeded): mutated requests to the deploy, scale, function and async APIs;
  ``status_5xx``, ``hangs`` (no answer in 10 s) and ``crashes`` (the gateway process gone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
import yaml
from quart_kernel.shedding import SHED_HEADER
from quart_stage import cliargs
from quart_tools.bench import machine_info, write_report
from quart_tools.bench.chaos_fuzz import fuzz
from quart_tools.bench.chaos_limits import async_32mb, capacity, deadline_summary, oversized_text, peak_rss
from quart_tools.bench.chaos_system import Gateway, _replica_pids, wait_serving

SCENARIOS = ("replica-kill", "keysmanager-kill", "replica-stop", "gateway-restart", "gateway-restart-default",
             "stream-replica-kill", "stream-keysmanager-kill", "stream-gateway-restart",  # stream-*: chaos_streams
             "stream-gateway-kill")
MODEL = "bert-21b"
BODY = json.dumps({"input_ids": [[1, 2, 3, 4]]}).encode()
RECOVERY_POLL_DELAY_S = 0.5  # recovered_s is at least this: a poll right after a kill still counts the victim


async def _headers_sent(session, ctx, params) -> None:
    ctx.trace_request_ctx["sent"] = time.perf_counter()


async def open_loop(gw: Gateway, path: str, body: bytes, rate: float, seconds: float, timeout_s: float,
                    headers: dict[str, str] | None = None, expect100: bool = False,
                    answers: list[tuple[int, float, bool]] | None = None) -> dict:
    """``rate`` req/s for ``seconds`` whatever the answers; every request's outcome and latency: ``ok_ms``
    from the request's headers sent to the answer's headers received (the span ``X-Quart-Timeout-Ms``
    bounds: the body's upload, the queue, the service), ``ok_full_ms`` from the call to the answer's last
    byte (the download of a large answer included). ``expect100``: ``Expect: 100-continue`` (as curl sends
    for bodies over 1 MB): a refused request's body is never sent. ``answers``: each answer's (status, ms from
    the headers sent, shed: a queued call refused 429 before its deadline, ``X-Quart-Shed``) appended."""
    out = {"sent": 0, "ok": 0, "explicit_error": 0, "lost": 0, "by_status": {}, "ok_ms": [], "ok_full_ms": []}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_headers_sent)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as session:
        async def one() -> None:
            start = time.perf_counter()
            ctx: dict[str, float] = {}
            try:
                async with session.post(gw.url + path, data=body, headers=headers, expect100=expect100,
                                        trace_request_ctx=ctx, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    answered = time.perf_counter()
                    await r.read()
                    if answers is not None:
                        answers.append((r.status, 1000 * (answered - ctx.get("sent", start)), SHED_HEADER in r.headers))
                    out["by_status"][str(r.status)] = out["by_status"].get(str(r.status), 0) + 1
                    if 200 <= r.status < 300:
                        out["ok"] += 1
                        out["ok_ms"].append(1000 * (answered - ctx.get("sent", start)))
                        out["ok_full_ms"].append(1000 * (time.perf_counter() - start))
                    else:
                        out["explicit_error"] += 1
            except TimeoutError:
                out["lost"] += 1
            except aiohttp.ClientError as exc:
                out["explicit_error"] += 1  # refused or reset: the client knows at once
                out["by_status"][type(exc).__name__] = out["by_status"].get(type(exc).__name__, 0) + 1

        tasks, t0 = [], time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            out["sent"] += 1
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return out


async def inject(name: str, gw: Gateway, seconds: float, rng: random.Random) -> float:
    """The fault of scenario ``name``; returns when its last fault ended (monotonic)."""
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(min(5.0, seconds / 4))
        if name == "replica-kill":
            kills = max(1, int(seconds * 0.6 / 3))
            for k in range(kills):
                pids = await _replica_pids(session, gw)
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                if k < kills - 1:
                    await asyncio.sleep(3.0)
            return time.monotonic()
        if name == "keysmanager-kill":
            os.kill(rng.choice([h["pid"] for h in gw.state()["hosts"]]), signal.SIGKILL)
            return time.monotonic()
        if name == "replica-stop":
            pid = rng.choice(await _replica_pids(session, gw))
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(5.0)
            os.kill(pid, signal.SIGCONT)
            return time.monotonic()
        if name.startswith("gateway-restart"):  # measured from the new process's start: imports and start count
            stopping = time.monotonic()
            await asyncio.to_thread(gw.stop)
            spawned = time.monotonic()
            # functions from the store, replicas adopted: --keep-hosts said, or by default (no flag)
            extra = ("--keep-hosts",) if name == "gateway-restart" else ()
            await asyncio.to_thread(gw.start, 120.0, extra)
            gw.phases = {"stop_s": round(spawned - stopping, 2),
                         "stopped_to_listening_s": round(time.monotonic() - spawned, 2)}
            return spawned
    raise ValueError(name)


async def scenario(name: str, gw: Gateway, rate: float, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    load = asyncio.create_task(open_loop(gw, f"/function/{MODEL}", BODY, rate, seconds, timeout_s=15.0,
                                         headers={"Content-Type": "application/json", "X-Quart-Timeout-Ms": "10000"}))
    fault_end = await inject(name, gw, seconds, rng)
    restart = name.startswith("gateway-restart")
    if not restart:  # a new gateway has no stale view of the fault to see first
        await asyncio.sleep(RECOVERY_POLL_DELAY_S)  # let the gateway see the fault before asking if all is well
    async with aiohttp.ClientSession() as session:
        serving_at = await wait_serving(session, gw, 120.0, want=3)
    result = await load
    result.pop("ok_full_ms")
    ok_ms = sorted(result.pop("ok_ms"))
    extra = {"phases": {**gw.phases, "listening_to_serving_s": round(serving_at - fault_end
                                                                    - gw.phases["stopped_to_listening_s"], 2)}} \
        if restart and gw.phases else {}
    return {"name": name, **result, "recovered_s": round(serving_at - fault_end, 2),
            "ok_p99_ms": round(ok_ms[int(0.99 * (len(ok_ms) - 1))], 1) if ok_ms else None, **extra}


def _stack(folder: Path, mean_ms: float, **options: int) -> Path:
    from quart_tools.partition import partition

    partition(MODEL, 3, str(folder), weights="none", progress=False,
              stack={"compute": "emulated", "scale_min": 2, "scale_max": 2, **options})
    path = folder / "stack.yml"
    doc = yaml.safe_load(path.read_text())
    for fn in doc["functions"].values():
        fn.setdefault("environment", {})["QUART_EMULATED_MEAN_MS"] = str(mean_ms)
    path.write_text(yaml.safe_dump(doc))
    return path


def _p(ordered: list[float], q: float) -> float | None:
    return round(ordered[int(q * (len(ordered) - 1))], 1) if ordered else None


def _p99(ordered: list[float]) -> float | None:
    return _p(ordered, 0.99)


async def overload(tmp: Path, factor: float, seconds: float, body_mb: int, deadline_ms: int,
                   expect100: bool = True) -> dict:
    gw = Gateway(tmp / "overload-state", ["--process-hosts", "--no-plugin", "--hosts", "1"])
    (tmp / "overload-state").mkdir()
    await asyncio.to_thread(gw.start)
    try:
        async with aiohttp.ClientSession() as session:
            labels = {"com.openfaas.scale.min": "1", "com.openfaas.scale.max": "1", "com.quart.concurrency": "1"}
            async with session.post(f"{gw.url}/system/functions", auth=gw.auth,
                                    json={"service": "echo", "image": "quart/echo", "labels": labels}) as r:
                assert r.status == 202, await r.text()
            await wait_serving(session, gw, 60)
            body = os.urandom(body_mb << 20)
            count, start = 0, time.monotonic()
            while time.monotonic() - start < 3.0:  # capacity, closed loop
                async with session.post(f"{gw.url}/function/echo", data=body) as r:
                    await r.read()
                count += 1
            capacity = count / (time.monotonic() - start)
        proc = psutil.Process(gw.process.pid)
        base = proc.memory_info().rss
        peak = [base]

        async def sample() -> None:
            while True:
                peak[0] = max(peak[0], proc.memory_info().rss)
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        result = await open_loop(gw, "/function/echo", body, capacity * factor, seconds, timeout_s=deadline_ms / 1000 + 30,
                                 headers={"X-Quart-Timeout-Ms": str(deadline_ms)}, expect100=expect100)
        sampler.cancel()
        ok_ms, full_ms = sorted(result.pop("ok_ms")), sorted(result.pop("ok_full_ms"))
        return {"factor": factor, "capacity_rps": round(capacity, 2), "body_mb": body_mb,
                "rss_growth_mb": round((peak[0] - base) / 2**20, 1), "accepted_p99_ms": _p99(ok_ms),
                "accepted_p50_ms": _p(ok_ms, 0.5), "accepted_full_p99_ms": _p99(full_ms), "expect100": expect100,
                "goodput_rps": round(result["ok"] / seconds, 2), "deadline_ms": deadline_ms, **result}
    finally:
        gw.stop()


async def overload_deadline(tmp: Path, factor: float, seconds: float, deadline_ms: int, mean_ms: float) -> dict:
    """The model at ``mean_ms`` per stage on its own gateway: its capacity closed-loop, then ``factor`` × that
    open-loop with ``X-Quart-Timeout-Ms`` (:func:`.chaos_limits.deadline_summary`) and the gateway's RSS."""
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
        rps = await capacity(gw, f"/function/{MODEL}", BODY, headers)
        base = psutil.Process(gw.process.pid).memory_info().rss
        stop = asyncio.Event()
        sampler = asyncio.create_task(peak_rss([gw.process.pid], stop))
        answers: list[tuple[int, float, bool]] = []
        result = await open_loop(gw, f"/function/{MODEL}", BODY, rps * factor, seconds, deadline_ms / 1000 + 30,
                                 {**headers, "X-Quart-Timeout-Ms": str(deadline_ms)}, answers=answers)
        stop.set()
        peak = await sampler
    finally:
        await asyncio.to_thread(gw.down)
    return {"factor": factor, "capacity_rps": round(rps, 1), "mean_ms": mean_ms, "deadline_ms": deadline_ms,
            **deadline_summary(answers, result["sent"], result["lost"], deadline_ms),
            "rss_growth_mb": round(max(0, peak - base) / 2**20, 1), "by_status": result["by_status"]}


async def run(args: argparse.Namespace) -> dict:
    doc: dict = {"scenarios": [], "machine": machine_info(load_before=os.getloadavg())}
    with tempfile.TemporaryDirectory(prefix="quart-chaos-") as name:
        tmp = Path(args.keep_dir) if args.keep_dir else Path(name)
        tmp.mkdir(parents=True, exist_ok=True)
        plain = [s for s in args.scenarios if not s.startswith("stream-")]
        streamed = [s for s in args.scenarios if s.startswith("stream-")]
        if plain:  # the emulated model's gateway: its scenarios, fuzz and limits
            stack = _stack(tmp / "model", args.mean_ms)
            state = tmp / "state"
            state.mkdir()
            gw = Gateway(state, ["--hosts", "2", "--gpus-per-host", "4", "-f", str(stack)])  # hosts kept: the default
            await asyncio.to_thread(gw.start, 300.0)
            try:
                async with aiohttp.ClientSession() as session:
                    if await wait_serving(session, gw, 300, want=3) == float("inf"):
                        raise RuntimeError("the model never served at its desired replicas")
                if args.fuzz_cases:
                    doc["fuzz"] = await fuzz(gw, args.fuzz_cases, args.seed)
                for i, scenario_name in enumerate(plain):
                    doc["scenarios"].append(await scenario(scenario_name, gw, args.rate, args.seconds, args.seed + i))
                    print(json.dumps(doc["scenarios"][-1]), file=sys.stderr)
                if args.limits:
                    async with aiohttp.ClientSession() as session:
                        pids = await _replica_pids(session, gw, f"{MODEL}-stage-0")
                    doc["oversized_text"] = await oversized_text(gw, MODEL, pids)
                    doc["async_32mb"] = await async_32mb(gw, MODEL)
            finally:
                await asyncio.to_thread(gw.down)
        if streamed:
            from quart_tools.bench.chaos_streams import stream_scenarios

            for entry in await stream_scenarios(tmp, streamed, args.streams, args.stream_tokens,
                                                args.stream_timeout, args.seed):
                doc["scenarios"].append(entry)
                print(json.dumps(entry), file=sys.stderr)
        if args.deadline_factor:
            doc["overload_deadline"] = await overload_deadline(tmp, args.deadline_factor, args.overload_seconds,
                                                               args.deadline_ms, args.deadline_mean_ms)
        if args.factor:
            doc["overload"] = await overload(tmp, args.factor, args.overload_seconds, args.body_mb, args.deadline_ms,
                                             not args.no_expect)
    doc["machine"]["load_after"] = os.getloadavg()
    doc["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
    return doc


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench chaos", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--scenarios", type=lambda s: [x for x in s.split(",") if x], default=list(SCENARIOS),
                   help=f"comma-separated, from {','.join(SCENARIOS)} ('' = none)")
    p.add_argument("--rate", type=float, default=30.0, help="open-loop requests/s per scenario")
    p.add_argument("--seconds", type=float, default=60.0, help="length of each scenario")
    p.add_argument("--mean-ms", type=float, default=5.0, help="emulated service time of each stage")
    p.add_argument("--fuzz-cases", type=int, default=2000)
    p.add_argument("--streams", type=int, default=16, help="stream-*: concurrent token streams")
    p.add_argument("--stream-tokens", type=int, default=48, help="stream-*: tokens each stream generates")
    p.add_argument("--stream-timeout", type=float, default=120.0,
                   help="stream-*: a stream that has not ended (last token or error) by then is a hang")
    p.add_argument("--factor", type=float, default=8.0, help="overload factor × measured capacity (0 = skip)")
    p.add_argument("--overload-seconds", type=float, default=10.0)
    p.add_argument("--body-mb", type=int, default=32)
    p.add_argument("--deadline-ms", type=int, default=2000)
    p.add_argument("--no-expect", action="store_true",
                   help="overload without Expect: 100-continue (refused bodies are uploaded, then dropped)")
    p.add_argument("--deadline-factor", type=float, default=8.0,
                   help="overload_deadline: open loop at this × the model's capacity with --deadline-ms (0 = skip)")
    p.add_argument("--deadline-mean-ms", type=float, default=40.0,
                   help="overload_deadline: emulated service time of each stage (its capacity stays in reach)")
    p.add_argument("--no-limits", dest="limits", action="store_false",
                   help="skip oversized_text and async_32mb")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--keep-dir", type=Path, default=None, help="work (state, logs) here and keep it")
    args = p.parse_args(argv)
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario(s) {bad}; from {SCENARIOS}")
    write_report(asyncio.run(run(args)), args.out, always_print=True)
    return 0
