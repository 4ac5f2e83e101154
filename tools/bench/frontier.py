"""`quartctl bench frontier --out FILE`: the live equal-cost frontier (issue 15's experiment, on `quartctl up`).

The live system of `quartctl bench policies` (EMULATED compute: the paper's BERT-21B split into 8
parameter-free stages that sleep their profiled times while real activation bytes travel over real HTTP;
embedded gateway, KeysManagers, router, controller): for every workload (gamma CV 1/4/8, the trace) the
static-k sweep (``--static-k``), QUART and every baseline (``--policies``) replay the same arrivals
(``--duration`` s each, ``--repeats`` times in rotated order). Entries carry the keys of the simulated
frontier (`quart_tools.sim.frontier`, table ``km``), and the summary is its `summarise`: QUART's mean ÷ the
live static frontier at QUART's replica-seconds. Beside every live entry, the simulator's figures for the
same run (same arrivals, stages, measured service times, hosts, slots, start replicas, policy:
`quart_tools.sim.validate.simulate`) and sim ÷ live of mean and p99 (issue 32: ≤ 5 % / 10 %).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from gateway_plugin.policies import POLICY_NAMES
from quart_stage import cliargs
from quart_tools.bench import machine_info, write_report
from quart_tools.bench.policies import (
    MODEL,
    PROFILED_MS,
    WORKLOADS,
    Gateway,
    aggregate,
    make_workload,
    one_run,
    partition,
    profile,
)
from quart_tools.sim.frontier import ENTRY_KEYS, summarise

SIM_TARGETS = {"mean": 0.05, "p99": 0.10}  # issue 32: |sim − live| / live


def _parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="quartctl bench frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-frontier.json", help="JSON report")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(p for p in POLICY_NAMES if p != "static"),
                   help="scaling policies besides the static sweep (comma-separated; '' = QUART's sweep only)")
    p.add_argument("--static-k", default="1,2,3,4,5,6", help="replicas per stage of the static sweep (comma-separated)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run (issue 32: >= 120)")
    p.add_argument("--repeats", type=int, default=1, help="runs per policy and workload, in rotated order")
    add_live_args(p)
    return p


def add_live_args(p: argparse.ArgumentParser) -> None:
    """The live emulated system's options (shared with `quartctl bench cpu-ablation`)."""
    p.add_argument("--rate", type=float, default=20.0, help="mean requests/s of every workload")
    p.add_argument("--activation-bytes", type=int, default=32 * 1024, help="emulated output bytes per stage")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--start-replicas", type=int, default=1, help="replicas per stage when a scaling run starts")
    p.add_argument("--max-replicas", type=int, default=6)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--gpus-per-host", type=int, default=24)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout (s)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds between the reset and the load")
    p.add_argument("--profile-requests", type=int, default=15)
    p.add_argument("--no-sim", action="store_true", help="live figures only")


def profile_stages(gw: Gateway, args: argparse.Namespace) -> dict:
    """Reset to the start replicas and profile: the pipeline's and stages' measured times, and the simulator's
    stage time and hop (``profiled_ms, measured_stage_service_ms, sim_stage_ms, sim_hop_s``)."""
    gw.switch("static", {"replicas": args.start_replicas})
    gw.wait_reset(gw.stages(MODEL), args.start_replicas, timeout_s=600)
    profiled_ms, service_ms = profile(gw, args.profile_requests)
    stage_ms = statistics.fmean(service_ms) if service_ms else PROFILED_MS / args.stages
    hop_s = max(0.0, (profiled_ms - sum(service_ms)) / 1000.0 / args.stages) if service_ms else 0.0
    return {"profiled_ms": profiled_ms, "measured_stage_service_ms": service_ms, "sim_stage_ms": stage_ms,
            "sim_hop_s": hop_s}


def _policies_args(args: argparse.Namespace, static_k: int) -> argparse.Namespace:
    """The namespace `quart_tools.bench.policies.one_run` reads, with static's count ``static_k``."""
    return argparse.Namespace(**{**vars(args), "static_replicas": static_k, "baselines_keysmanager": "off",
                                 "policy_config": [], "model": MODEL, "control_period": 1.0})


def _simulated(args, policy: str, replicas: int, arrivals, stage_ms: float, hop_s: float, start_s: float | None) -> dict:
    from quart_tools.sim.validate import simulate

    ns = argparse.Namespace(hosts=args.hosts, gpus_per_host=args.gpus_per_host, stage_ms=stage_ms, stages=args.stages,
                            replicas=replicas, max_replicas=args.max_replicas, seed=args.seed, policy=policy)
    sim = simulate(ns, arrivals, hop_s, start_s)
    sim.pop("series", None)
    return sim


def run(args: argparse.Namespace) -> dict:
    workloads = [w for w in args.workloads.split(",") if w]
    policies = [p for p in args.policies.split(",") if p]
    ks = [int(k) for k in args.static_k.split(",") if k]
    if "quart" not in policies:
        policies.insert(0, "quart")
    unknown = [p for p in policies if p not in POLICY_NAMES or p == "static"]
    if unknown or not ks or min(ks) < 1 or max(ks) > args.max_replicas:
        raise ValueError(f"--policies: unknown {unknown} (static is --static-k); --static-k in 1..{args.max_replicas}")
    tmp = Path(tempfile.mkdtemp(prefix="quart-bench-frontier-"))
    stack = partition(tmp / "model", args.stages, args.max_replicas, args.activation_bytes, MODEL)
    env = {"QUART_POLICY": "static", "QUART_CONTROL_PERIOD_S": "1.0", "QUART_WINDOW_S": "5",
           "QUART_REQUEST_TIMEOUT_S": str(args.timeout), "QUART_QUEUE_CAP": "4096"}
    gw = Gateway(stack, tmp / "state", args.hosts, args.gpus_per_host, env)
    gw.model = MODEL
    runs = [(p, args.start_replicas, p) for p in policies] + [(f"static-{k}", k, "static") for k in ks]
    report: dict = {"benchmark": "frontier", "compute": "emulated", "model": MODEL, "stages": args.stages,
                    "rate_rps": args.rate, "duration_s": args.duration, "repeats": args.repeats, "seed": args.seed,
                    "static_k": ks, "policies": policies, "machine": machine_info(), "entries": []}
    try:
        stages = gw.stages(MODEL)
        measured = profile_stages(gw, args)
        report.update(measured)
        profiled_ms, stage_ms, hop_s = measured["profiled_ms"], measured["sim_stage_ms"], measured["sim_hop_s"]
        for workload in workloads:
            arrivals = make_workload(workload, args.rate, args.duration, args.seed)
            done: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
            for rep in range(args.repeats):
                for label, k, policy in runs[rep % len(runs):] + runs[:rep % len(runs)]:
                    done[label].append(one_run(gw, stages, workload, policy, arrivals, profiled_ms,
                                               _policies_args(args, k)))
            for label, k, policy in runs:
                live = aggregate(policy, done[label], profiled_ms, _policies_args(args, k))
                entry = {key: live.get(key) for key in ENTRY_KEYS}
                entry.update(workload=workload, seed=args.seed, policy=label, table="km", model=MODEL,
                             repeats=args.repeats, errors=live.get("errors"))
                if not args.no_sim:
                    lags = [x for r in done[label] for x in r["lags"]]
                    sim = _simulated(args, policy, k, arrivals, stage_ms, hop_s, statistics.median(lags) if lags else None)
                    entry["sim"] = sim
                    entry["sim_over_live"] = {m: sim[f"{m}_ms"] / entry[f"{m}_ms"] - 1.0 if entry[f"{m}_ms"] else None
                                              for m in ("mean", "p99")}
                report["entries"].append(entry)
                print(f"[{workload}] {label}: mean {entry['mean_ms']:.0f} ms, p99 {entry['p99_ms']:.0f} ms, "
                      f"replica-s {entry['replica_seconds']:.0f}"
                      + (f"; sim mean {entry['sim']['mean_ms']:.0f} p99 {entry['sim']['p99_ms']:.0f}" if "sim" in entry else ""),
                      file=sys.stderr)
    finally:
        gw.close()
    report["summary"] = summarise(report["entries"])
    report["sim_targets"] = SIM_TARGETS
    return report


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from quart_tools.report import json_safe

    write_report(json_safe(run(args)), args.out)
    return 0
