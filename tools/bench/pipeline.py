"""`quartctl bench pipeline`: what the pipeline path costs per stage against one function call.

Starts `quartctl up --process-hosts` with the QUART plugin (actuator ``none``: the controller observes,
nothing scales), deploys ``--stages`` built-in ``quart/echo`` functions labelled as the stages of one
model (concurrency 64 per replica, so neither path queues on a slot), and in the same run measures:

- Latency (one request at a time, one keep-alive connection per path, the paths interleaved, order
  rotated every round): the stage-0 replica directly, ``/function/<stage 0>`` (one function through the
  gateway) and ``/function/<model>`` (the pipeline). ``p50_added_single_ms`` = single − direct,
  ``p50_added_per_stage_ms`` = (pipeline − stages × direct) / stages.
- Throughput (closed loop, ``--connections`` keep-alive connections, ``wrk`` when it can be had, else
  our asyncio client): ``rps_single`` and ``rps_pipeline``, medians of ``--rounds`` alternated runs. The targets (issue 26):
  ``rps_pipeline × stages ≥ 0.8 × rps_single`` and ``p50_added_per_stage_ms ≤ 1.2 × p50_added_single_ms``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from quart_provider.system import stop_process
from quart_stage import cliargs
from quart_tools.bench import write_report
from quart_tools.bench.gateway import (
    Connection,
    _pct,
    _start_gateway,
    add_load_args,
    choose_client,
    deploy_echo,
    run_facts,
)
from quart_tools.bench.gateway import _throughput as closed_loop
from quart_tools.bench.wrk import run_wrk, write_script
from tqdm import tqdm

MODEL = "echo-pipe"


def _stage_labels(stage: int, stages: int) -> dict[str, str]:
    return {"com.quart.model": MODEL, "com.quart.stage": str(stage), "com.quart.stages": str(stages),
            "com.quart.concurrency": "64"}


async def _latency(url: str, replica_url: str, single: str, body: bytes, count: int, warmup: int) -> dict:
    paths = {"direct": (replica_url, "/"), "single": (url, f"/function/{single}"),
             "pipeline": (url, f"/function/{MODEL}")}
    return await interleaved_p50(paths, body, count, warmup)


async def interleaved_p50(paths: dict[str, tuple[str, str]], body: bytes, count: int, warmup: int) -> dict:
    """p50 of each ``name: (base url, path)``, one request at a time on one keep-alive connection per path, the
    paths interleaved and their order rotated every round: ``{"p50_<name>_ms": ...}``."""
    conns = {name: await Connection.open(base) for name, (base, _) in paths.items()}
    raws = {name: conns[name].request_bytes(path, body) for name, (_, path) in paths.items()}
    names = list(paths)
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for i in tqdm(range(warmup + count), desc="latency rounds", disable=not sys.stderr.isatty()):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = clock()
            status = await conns[name].send(raws[name])
            elapsed = clock() - start
            if status != 200:
                raise RuntimeError(f"{name} request answered {status}")
            if i >= warmup:
                times[name].append(elapsed * 1000)
    for conn in conns.values():
        conn.close()
    return {f"p50_{name}_ms": _pct(values, 0.5) for name, values in times.items()}


def _throughput(client: str, tmp: Path, url: str, single: str, body: bytes, connections: int,
                seconds: float, rounds: int) -> dict:
    """Closed-loop req/s of the single function and of the pipeline, alternated over ``rounds`` runs of each
    (the order flipped every round); the medians, so a burst of load on the shared machine moves one run."""
    paths = {"single": f"/function/{single}", "pipeline": f"/function/{MODEL}"}
    runs: dict[str, list[float]] = {name: [] for name in paths}
    p50s: dict[str, list[float]] = {name: [] for name in paths}
    script = write_script(tmp, len(body)) if client != "python" else None
    if script is not None:
        for path in paths.values():
            run_wrk(client, f"{url}{path}", script, connections, 1)  # warm the pools
    for i in range(rounds):
        for name, path in (list(paths.items()) if i % 2 == 0 else list(paths.items())[::-1]):
            if script is None:
                runs[name].append(asyncio.run(closed_loop(url, path, body, connections, seconds)))
                continue
            res = run_wrk(client, f"{url}{path}", script, connections, seconds)
            runs[name].append(res.rps)
            p50s[name].append(res.p50_ms)
    out: dict = {f"rps_{name}": round(statistics.median(values), 1) for name, values in runs.items()}
    out["runs"] = {name: [round(v, 1) for v in values] for name, values in runs.items()}
    if script is not None:
        out["loaded"] = {f"p50_{name}_ms": statistics.median(values) for name, values in p50s.items()}
    return out


def run(stages: int, body_bytes: int, count: int, warmup: int, connections: int, seconds: float,
        client: str = "auto", rounds: int = 3) -> dict:
    client, client_name = choose_client(client)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="quart-bench-pipe-") as tmp:
        process, url, auth = _start_gateway(Path(tmp), plugin=True, env={"QUART_ACTUATOR": "none"})
        try:
            names = [f"{MODEL}-s{i}" for i in range(stages)]
            replicas = [deploy_echo(url, auth, name, _stage_labels(i, stages)) for i, name in enumerate(names)]
            body = os.urandom(body_bytes)
            try:
                import uvloop

                uvloop.install()
            except ImportError:  # pragma: no cover
                pass
            latency = asyncio.run(_latency(url, replicas[0], names[0], body, count, warmup))
            loaded = _throughput(client, Path(tmp), url, names[0], body, connections, seconds, rounds)
        finally:
            stop_process(process.pid, process)
    direct = latency["p50_direct_ms"]
    added_single = latency["p50_single_ms"] - direct
    added_stage = (latency["p50_pipeline_ms"] - stages * direct) / stages
    rps_single, rps_pipeline = loaded["rps_single"], loaded["rps_pipeline"]
    return {
        "stages": stages, "rps_single": rps_single, "rps_pipeline": rps_pipeline,
        "p50_added_single_ms": round(added_single, 4), "p50_added_per_stage_ms": round(added_stage, 4),
        "ratio_rps_pipeline_x_stages_vs_single": round(rps_pipeline * stages / rps_single, 3) if rps_single else None,
        "ratio_added_per_stage_vs_single": round(added_stage / added_single, 3) if added_single > 0 else None,
        **{k: round(v, 4) for k, v in latency.items()},
        **({"loaded": loaded["loaded"]} if "loaded" in loaded else {}),
        "throughput_runs": loaded["runs"], "connections": connections, "latency_rounds": count,
        **run_facts(client_name, body_bytes, seconds, load_start),
    }


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--requests", type=int, default=2000, help="latency rounds measured (after warm-up)")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3, help="throughput runs of each path, alternated (medians kept)")
    add_load_args(p)
    p.set_defaults(seconds=3.0)
    args = p.parse_args(argv)
    if args.stages < 1:
        p.error("--stages must be at least 1")
    result = run(args.stages, args.body_bytes, args.requests, args.warmup, args.connections, args.seconds,
                 args.client, max(1, args.rounds))
    write_report(result, args.out, always_print=True)
    return 0
