"""`quartctl bench cpu-ablation --out FILE`: QUART with and without CPU compensation, live, on the same arrivals.

The live system of `quartctl bench frontier` (EMULATED compute: the paper's BERT-21B in 8 parameter-free stages,
embedded gateway, KeysManagers, router, controller) with one addition, stated as emulated: each stage's emulated
time follows the CPUs its replica holds, × (1 − f + f/c) with c its cores (its CPU affinity) and f =
``--cpu-fraction`` (``QUART_EMULATED_CPU_FRACTION``; 0.795 = QUART Fig. 3b's hardware, the simulator's default),
and QUART's CPU regression is fitted on profiling records of that same law (``QUART_CPU_PROFILE``). Granted CPUs
reach a replica in place (`quart_kernel.resize`: the KeysManager re-pins its threads). Variants (``quart`` and
``-cpu`` = ``cpu.enabled`` false) replay the same arrivals ``--repeats`` times in rotated order; each entry
carries mean / p99, replica-seconds, CPU-seconds (Σ replicas × CPUs over the controller's steps) and the control
steps with CPUs granted, and beside it the simulator's figures for the same run (same arrivals, stages,
measured service and start times, the same CPU law).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from quart_stage import cliargs
from quart_tools.bench import machine_info, write_report
from quart_tools.bench.frontier import add_live_args, profile_stages
from quart_tools.bench.policies import MODEL, WORKLOADS, Gateway, aggregate, make_workload, one_run, partition

VARIANTS = {"quart": {}, "-cpu": {"cpu": {"enabled": False}}}


def _parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="quartctl bench cpu-ablation", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-cpu-ablation.json", help="JSON report")
    p.add_argument("--workload", default="gamma-cv8", choices=WORKLOADS)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run (issue 32: >= 120)")
    p.add_argument("--repeats", type=int, default=1, help="runs per variant, in rotated order")
    p.add_argument("--cpu-fraction", type=float, default=0.795,
                   help="share of the emulated time that parallelises over a replica's cores (QUART Fig. 3b: 0.795)")
    p.add_argument("--cpu-max", type=float, default=float(len(os.sched_getaffinity(0))),
                   help="CPU_max per replica (default: this machine's cores: a grant beyond them cannot be pinned)")
    p.add_argument("--cold-starts", action="store_true",
                   help="QUART's stages without the KeysManager cache (every new replica a cold start of seconds: "
                        "the long starts the bridge covers)")
    add_live_args(p)
    return p


def cpu_profile_records(fraction: float, cpu_max: float) -> list[dict]:
    """Profiling records of the emulated law at 1…max(4, ⌈cpu_max⌉) CPUs (what the regression is fitted on; the
    fit needs 3 records at least)."""
    from quart_tools.sim.calibration import Calibration

    return Calibration(cpu_fraction=fraction).cpu_profile(max(4, int(cpu_max + 0.999)))


def cpu_seconds(timeline: list[dict]) -> tuple[float, int]:
    """(Σ replicas × CPUs × step over the controller's steps, steps with any stage above 1 CPU)."""
    total, granted = 0.0, 0
    for row, nxt in zip(timeline, timeline[1:], strict=False):
        cpus = row.get("cpus") or [1.0] * len(row["replicas"])
        total += sum(r * c for r, c in zip(row["replicas"], cpus, strict=True)) * (nxt["time"] - row["time"])
        granted += any(c > 1.0 for c in cpus)
    return total, granted


def _stack_with_cpu_law(stack: Path, fraction: float) -> None:
    import yaml

    doc = yaml.safe_load(stack.read_text())
    for fn in doc["functions"].values():
        fn.setdefault("environment", {})["QUART_EMULATED_CPU_FRACTION"] = str(fraction)
    stack.write_text(yaml.safe_dump(doc, sort_keys=False))


def _args(args: argparse.Namespace, variant: str) -> argparse.Namespace:
    config = {"cpu": {"cpu_max": args.cpu_max, "cpu_step": 1.0}}
    config["cpu"].update(VARIANTS[variant].get("cpu", {}))
    return argparse.Namespace(**{**vars(args), "static_replicas": args.start_replicas, "baselines_keysmanager": "off",
                                 "policy_config": [f"quart={json.dumps(config)}"], "model": MODEL,
                                 "control_period": 1.0})


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="quart-bench-cpu-ablation-"))
    stack = partition(tmp / "model", args.stages, args.max_replicas, args.activation_bytes, MODEL)
    _stack_with_cpu_law(stack, args.cpu_fraction)
    profile_path = tmp / "cpu_profile.jsonl"
    profile_path.write_text("".join(json.dumps(r) + "\n" for r in cpu_profile_records(args.cpu_fraction, args.cpu_max)))
    env = {"QUART_POLICY": "static", "QUART_CONTROL_PERIOD_S": "1.0", "QUART_WINDOW_S": "5",
           "QUART_REQUEST_TIMEOUT_S": str(args.timeout), "QUART_QUEUE_CAP": "4096", "QUART_CPU_PROFILE": str(profile_path)}
    gw = Gateway(stack, tmp / "state", args.hosts, args.gpus_per_host, env)
    gw.model = MODEL
    report: dict = {"benchmark": "cpu-ablation", "compute": "emulated", "model": MODEL, "workload": args.workload,
                    "stages": args.stages, "rate_rps": args.rate, "duration_s": args.duration, "repeats": args.repeats,
                    "seed": args.seed, "cpu_fraction": args.cpu_fraction, "cpu_max": args.cpu_max,
                    "cold_starts": args.cold_starts,
                    "machine": machine_info(loadavg_start=[round(x, 2) for x in os.getloadavg()]), "entries": []}
    try:
        stages = gw.stages(MODEL)
        measured = profile_stages(gw, args)
        report.update(measured)
        profiled_ms, stage_ms, hop_s = measured["profiled_ms"], measured["sim_stage_ms"], measured["sim_hop_s"]
        arrivals = make_workload(args.workload, args.rate, args.duration, args.seed)
        names = list(VARIANTS)
        done: dict[str, list[dict]] = {v: [] for v in names}
        for rep in range(args.repeats):
            for variant in names[rep % len(names):] + names[:rep % len(names)]:
                done[variant].append(one_run(gw, stages, args.workload, "quart", arrivals, profiled_ms,
                                             _args(args, variant)))
        for variant in names:
            live = aggregate("quart", done[variant], profiled_ms, _args(args, variant))
            spent = [cpu_seconds(r["timeline"]) for r in done[variant]]
            entry = {k: live.get(k) for k in ("mean_ms", "p50_ms", "p99_ms", "replica_seconds", "errors")}
            entry.update(variant=variant, cpu_seconds=statistics.fmean(s for s, _ in spent),
                         steps_with_cpus=statistics.fmean(g for _, g in spent))
            if not args.no_sim:
                entry["sim"] = _simulated(args, variant, arrivals, stage_ms, hop_s, done[variant])
            report["entries"].append(entry)
            print(f"{variant}: mean {entry['mean_ms']:.0f} ms, p99 {entry['p99_ms']:.0f} ms, replica-s "
                  f"{entry['replica_seconds']:.0f}, CPU-s {entry['cpu_seconds']:.0f}, steps with CPUs "
                  f"{entry['steps_with_cpus']:.0f}", file=sys.stderr)
    finally:
        gw.close()
    base, full = (next(e for e in report["entries"] if e["variant"] == v) for v in ("-cpu", "quart"))
    report["quart_over_minus_cpu"] = {m: full[m] / base[m] if base[m] else None
                                      for m in ("mean_ms", "p99_ms", "replica_seconds", "cpu_seconds")}
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _simulated(args, variant: str, arrivals, stage_ms: float, hop_s: float, runs: list[dict]) -> dict:
    from quart_tools.sim.validate import simulate

    lags = [x for r in runs for x in r["lags"]]
    ns = argparse.Namespace(hosts=args.hosts, gpus_per_host=args.gpus_per_host, stage_ms=stage_ms, stages=args.stages,
                            replicas=args.start_replicas, max_replicas=args.max_replicas, seed=args.seed, policy="quart")
    config = json.loads(_args(args, variant).policy_config[0].split("=", 1)[1])
    sim = simulate(ns, arrivals, hop_s, statistics.median(lags) if lags else None, config, args.cpu_fraction)
    sim.pop("series", None)
    return sim


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from quart_tools.report import json_safe

    write_report(json_safe(run(args)), args.out)
    return 0
