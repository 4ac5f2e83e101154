"""`quartctl bench cpu-profile`: service times of real stages at 1…CPU_max CPUs (QUART §5.3's profiling).

The packaged MiniLM (real weights) is partitioned for real into ``--stages`` stages; each stage runs in
this process through `StageRuntime.handle` (safetensors wire in and out, as a replica serves it) with
``c`` torch threads AND the CPU affinity of ``c`` cores, for c = 1…``--cpu-max``, at several batch sizes
(so activation bytes vary). Thread counts are interleaved within each round so machine load hits every
c alike; after each change one untimed call lets torch resize its thread pool. Each timed call is one profiling record of the CPU regression
(`gateway_plugin.policies.cpu_model`): ``{"cpus", "queue_len": 0, "param_bytes", "activation_bytes",
"service_ms"}``, one JSON line each in ``--records`` (the file QUART_CPU_PROFILE reads; the product's
default profile is one such file). The JSON report: the median per (stage, batch, cpus), the fitted
model's per-CPU service ratios and the CPU-dependent fraction the simulator calibrates with.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from gateway_plugin.policies.cpu_model import CPULatencyModel
from quart_stage import cliargs, wire
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_tools.bench import machine_info, write_report
from quart_tools.bench.realmodel import _inputs
from quart_tools.partition import partition

CALLS = 3  # timed calls per (round, CPU count), after one untimed call at the new thread count


def _batch(inputs: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """The fixture's sentences repeated to ``size`` rows."""
    rows = inputs["input_ids"].shape[0]
    reps = -(-size // rows)
    return {k: v.repeat(reps, 1)[:size] for k, v in inputs.items()}


def _set_cpus(cpus: int, cores: list[int]) -> None:
    os.sched_setaffinity(0, cores[:cpus])
    torch.set_num_threads(cpus)


def profile(stages: int, cpu_max: int, batches: list[int], rounds: int, work: str) -> list[dict]:
    """Profiling records of every stage × batch × CPUs, ``rounds`` timed calls each (after one warm-up)."""
    model_dir = str(Path(work) / f"minilm-{stages}")
    partition("minilm", stages, model_dir, progress=False)
    runtimes = [StageRuntime.load(StageConfig(model_dir=model_dir, stage_index=i, threads=1)) for i in range(stages)]
    for rt in runtimes:
        rt.prepare_device()
    base = _inputs("minilm", model_dir)
    cores = sorted(os.sched_getaffinity(0))
    cpu_max = min(cpu_max, len(cores))
    records: list[dict] = []
    try:
        for size in batches:
            body = wire.encode_bytes(_batch(base, size))
            bodies = []  # each stage's input body
            for rt in runtimes:
                bodies.append(body)
                resp = rt.handle(body, {"Content-Type": wire.CONTENT_TYPE})
                if resp.status != 200:
                    raise RuntimeError(f"stage {rt.stage_index}: {resp.status} {resp.body[:200]!r}")
                body = resp.body
            for i, (rt, inp) in enumerate(zip(runtimes, bodies, strict=True)):
                params = sum(p.numel() * p.element_size() for p in rt.module.parameters()) if rt.module else 0
                for _ in range(rounds):
                    for c in range(1, cpu_max + 1):  # interleaved: load hits every c alike
                        _set_cpus(c, cores)
                        rt.handle(inp, {"Content-Type": wire.CONTENT_TYPE})  # untimed: the thread pool resizes
                        for _ in range(CALLS):
                            t0 = time.perf_counter()
                            rt.handle(inp, {"Content-Type": wire.CONTENT_TYPE})
                            ms = (time.perf_counter() - t0) * 1e3
                            records.append({"cpus": c, "queue_len": 0, "param_bytes": params,
                                            "activation_bytes": len(inp), "service_ms": round(ms, 3),
                                            "stage": i, "batch": size})
    finally:
        os.sched_setaffinity(0, cores)
    return records


def summary(records: list[dict], cpu_max: int) -> dict:
    """Median per (stage, batch, cpus); the fitted model's service ratio t(c)/t(1) and CPU fraction."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        groups.setdefault((r["stage"], r["batch"], r["cpus"]), []).append(r["service_ms"])
    medians = [{"stage": s, "batch": b, "cpus": c, "median_ms": round(statistics.median(v), 3), "n": len(v)}
               for (s, b, c), v in sorted(groups.items())]
    model = CPULatencyModel.fit(records)
    return {"medians": medians, "fit": {"records": model.records, "r2": round(model.r2, 4),
                                        "ratio_vs_1_cpu": {c: round(model.service_ratio(1, c), 4)
                                                           for c in range(1, cpu_max + 1)},
                                        "cpu_fraction": round(model.cpu_fraction(), 4)}}


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench cpu-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON report (default stdout)")
    p.add_argument("--records", default=None, help="JSONL profiling records (QUART_CPU_PROFILE's format)")
    p.add_argument("--stages", type=int, default=1, help="MiniLM stages (default 1: the whole model, one stage)")
    p.add_argument("--cpu-max", type=int, default=2, help="profile 1…CPU_max CPUs (capped at the cores this process may use)")
    p.add_argument("--batches", default="1,8,32", help="sentences per request, comma separated (default 1,8,32)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per stage and batch; each times 3 calls at every CPU count (default 5)")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.cpu_max < 1 or args.rounds < 1 or not batches or min(batches) < 1:
        p.error("--cpu-max, --rounds and every --batches value must be >= 1")
    with tempfile.TemporaryDirectory(prefix="quart-bench-cpu-profile-") as work:
        records = profile(args.stages, args.cpu_max, batches, args.rounds, work)
    if args.records:
        Path(args.records).write_text("".join(json.dumps(r) + "\n" for r in records))
    load = os.getloadavg()
    report = {"benchmark": "cpu-profile", "model": "minilm", "stages": args.stages, "batches": batches,
              "rounds": args.rounds, "machine": machine_info(torch=torch.__version__, loadavg=[round(x, 2) for x in load],
                                     omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "")),
              **summary(records, min(args.cpu_max, len(os.sched_getaffinity(0))))}
    write_report(report, args.out)
    print(json.dumps(report["fit"]), file=sys.stderr)
    return 0
