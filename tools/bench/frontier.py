"""`quartctl bench frontier --out FILE`: the live equal-cost frontier (issue 15's experiment, on `quartctl up`).

The live system of `quartctl bench policies` (EMULATED compute: the paper's BERT-21B split into 8
parameter-free stages that sleep their profiled times while real activation bytes travel over real HTTP;
embedded gateway, KeysManagers, router, controller): for every workload (gamma CV 1/4/8, the trace) the
static-k sweep (``--static-k``), QUART and every baseline (``--policies``) replay the same arrivals
(``--duration`` s each, ``--repeats`` times in rotated order). Entries carry the keys of the simulated
frontier (`quart_tools.sim.frontier`, table ``km``), and the summary is its `summarise`: QUART's mean ÷ the
live static frontier at QUART's replica-seconds. Beside every live entry, the simulator's figures for the
same run (same arrivals, stages, hosts, slots, start replicas, policy: `quart_tools.sim.validate.simulate`) and
sim ÷ live of mean and p99 (issue 32: ≤ 5 % / 10 %). The simulator gets the costs outside the emulated compute
that `quart_tools.bench.hop_costs` measures on this gateway before the runs (the sleep's overshoot, each stage
call's hold, the router's dispatch, the router and the front: ``--costs measure``) or that a calibration file
records; each entry also carries the same decomposition of its own run (``live_costs``) and the simulator's
figures with those (``sim_own_costs``): the part of sim ÷ live that the costs measured before the runs miss.

``--dry-run`` prints the run list and the wall-time arithmetic (`quart_tools.bench.frontier_plan`) and runs
nothing; ``--static-k auto`` runs, per workload, only the static-k that bracket QUART's replica-seconds as the
simulator predicts them (with the calibration file's costs) — the only static points QUART's frontier value
interpolates between.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gateway_plugin.policies import POLICY_NAMES
from quart_stage import cliargs
from quart_tools.bench import machine_info, write_report
from quart_tools.bench.frontier_plan import Overheads, PlannedRun, bracket_k, format_plan, plan_runs
from quart_tools.bench.hop_costs import costs_of, decompose, measure, nominal_stage_ms, records_env, sim_terms
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
CALIBRATION = str(Path(__file__).resolve().parent.parent / "sim" / "calibration.live.json")
PLAN_START_S = 1.0  # the live ask → ready lag the planning simulation assumes (measured: docs/benchmarks.md)


def _parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="quartctl bench frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-frontier.json", help="JSON report")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(p for p in POLICY_NAMES if p != "static"),
                   help="scaling policies besides the static sweep (comma-separated; '' = QUART's sweep only)")
    p.add_argument("--static-k", default="1,2,3,4,5,6",
                   help="replicas per stage of the static sweep (comma-separated), or 'auto': the k that bracket "
                        "QUART's simulated replica-seconds, per workload")
    p.add_argument("--baselines-keysmanager", choices=("off", "on", "both"), default="off",
                   help="baselines without the KeysManager (as the paper ran them), with it (label +km), or both")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run (issue 32: >= 120)")
    p.add_argument("--repeats", type=int, default=1, help="runs per policy and workload, in rotated order")
    add_live_args(p)
    p.add_argument("--costs", default="measure",
                   help="the simulator's live costs: 'measure' (bench hop-costs' phases on this gateway before "
                        "the runs) or a calibration JSON with live_* fields")
    p.add_argument("--calibration", default=CALIBRATION, help="calibration JSON whose live_* costs plan --static-k auto")
    p.add_argument("--costs-duration", type=float, default=30.0, help="seconds of the loaded cost phase")
    p.add_argument("--trace", default=None, help="trace CSV of the trace workload (default: the shared Azure code trace)")
    p.add_argument("--dry-run", action="store_true", help="print the run list and the wall-time estimate; run nothing")
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


def _policies_args(args: argparse.Namespace, run: PlannedRun) -> argparse.Namespace:
    """The namespace `quart_tools.bench.policies.one_run` reads, for one planned run."""
    return argparse.Namespace(**{**vars(args), "static_replicas": run.replicas, "start_replicas": run.replicas,
                                 "baselines_keysmanager": "on" if run.keysmanager else "off",
                                 "policy_config": [], "model": MODEL, "control_period": 1.0})


def _sim_args(args, policy: str, replicas: int, stage_ms: float) -> argparse.Namespace:
    return argparse.Namespace(hosts=args.hosts, gpus_per_host=args.gpus_per_host, stage_ms=stage_ms,
                              stages=args.stages, replicas=replicas, max_replicas=args.max_replicas, seed=args.seed,
                              policy=policy)


def simulated(args, policy: str, replicas: int, arrivals, costs: dict, start_s: float | None) -> dict:
    """The simulator's figures for one run, with the live costs ``costs`` (`hop_costs.sim_terms`)."""
    from quart_tools.sim.validate import simulate

    t = sim_terms(costs, args.stages)
    sim = simulate(_sim_args(args, policy, replicas, t["stage_ms"]), arrivals, t["hop_s"], start_s,
                   outside_s=t["outside_s"], service_cv=t["service_cv"], hop_per_call_s=t["hop_per_call_s"],
                   dispatch_s=t["dispatch_s"])
    sim.pop("series", None)
    return sim


def static_ks(args, workloads: list[str]) -> dict[str, list[int]]:
    """Per workload, the static sweep: ``--static-k``'s list, or (auto) the k around QUART's simulated cost."""
    if args.static_k != "auto":
        ks = [int(k) for k in args.static_k.split(",") if k]
        if not ks or min(ks) < 1 or max(ks) > args.max_replicas:
            raise ValueError(f"--static-k: integers in 1..{args.max_replicas}, or auto")
        return {w: ks for w in workloads}
    from quart_tools.sim.calibration import Calibration

    costs = costs_of(Calibration.load(args.calibration))
    out = {}
    for w in workloads:
        sim = simulated(args, "quart", args.start_replicas, make_workload(w, args.rate, args.duration, args.seed, args.trace),
                        costs, PLAN_START_S)
        out[w] = bracket_k(sim["replica_seconds"], args.stages, args.duration, args.max_replicas)
    return out


def planned(args) -> tuple[list[PlannedRun], dict[str, list[int]]]:
    workloads = [w for w in args.workloads.split(",") if w]
    policies = [p for p in args.policies.split(",") if p]
    if "quart" not in policies:
        policies.insert(0, "quart")
    unknown = [p for p in policies if p not in POLICY_NAMES or p == "static"]
    if unknown:
        raise ValueError(f"--policies: unknown {unknown} (static is --static-k)")
    ks = static_ks(args, workloads)
    return plan_runs(workloads, policies, ks, args.repeats, args.baselines_keysmanager, args.start_replicas), ks


def _new_records(path: Path, seen: int) -> tuple[list[dict], int]:
    import json

    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines[seen:] if x.strip()], len(lines)


def run(args: argparse.Namespace) -> dict:
    runs, ks = planned(args)
    tmp = Path(tempfile.mkdtemp(prefix="quart-bench-frontier-"))
    stack = partition(tmp / "model", args.stages, args.max_replicas, args.activation_bytes, MODEL)
    records_path = tmp / "records.jsonl"
    gw = Gateway(stack, tmp / "state", args.hosts, args.gpus_per_host, records_env(records_path))
    gw.model = MODEL
    report: dict = {"benchmark": "frontier", "compute": "emulated", "model": MODEL, "stages": args.stages,
                    "rate_rps": args.rate, "duration_s": args.duration, "repeats": args.repeats, "seed": args.seed,
                    "static_k": ks, "baselines_keysmanager": args.baselines_keysmanager,
                    "runs_planned": len(runs), "machine": machine_info(), "entries": []}
    started = time.monotonic()
    try:
        stages = gw.stages(MODEL)
        measured = measure(gw, stages, records_path, rate=args.rate, duration=args.costs_duration,
                           replicas=args.max_replicas, idle_requests=30, seed=args.seed + 1000)
        report["costs_measured"] = measured
        if args.costs == "measure":
            costs = measured["loaded"]
        else:
            from quart_tools.sim.calibration import Calibration

            costs = costs_of(Calibration.load(args.costs))
        report["sim_costs"] = {"source": args.costs, **sim_terms(costs, args.stages)}
        profiled_ms = measured["idle"]["client_median_ms"]
        report["profiled_ms"] = profiled_ms
        report["setup_s"] = round(time.monotonic() - started, 1)
        seen = _new_records(records_path, 0)[1]
        done: dict[tuple[str, str], list[dict]] = {}
        for r in runs:
            t0 = time.monotonic()
            res = one_run(gw, stages, r.workload, r.policy, make_workload(r.workload, args.rate, args.duration,
                                                                          args.seed, args.trace), profiled_ms, _policies_args(args, r))
            time.sleep(0.5)
            res["records"], seen = _new_records(records_path, seen)
            res["wall_s"] = time.monotonic() - t0
            done.setdefault((r.workload, r.label), []).append(res)
        for (workload, label), results in done.items():
            r = next(x for x in runs if (x.workload, x.label) == (workload, label))
            report["entries"].append(_entry(args, r, results, profiled_ms, costs))
    finally:
        gw.close()
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["run_wall_s"] = {"mean": statistics.fmean(e["run_wall_s"] for e in report["entries"]) if runs else None}
    report["summary"] = summarise(report["entries"])
    report["sim_targets"] = SIM_TARGETS
    return report


def _over(sim: dict, live: dict) -> dict:
    """sim ÷ live − 1 of the mean and the p99."""
    return {m: sim[f"{m}_ms"] / live[f"{m}_ms"] - 1.0 if live[f"{m}_ms"] else None for m in ("mean", "p99")}


def _entry(args, r: PlannedRun, results: list[dict], profiled_ms: float, costs: dict) -> dict:
    """One report entry over a label's repeats: live figures, the run's own costs, the simulator's figures."""
    live = aggregate(r.policy, results, profiled_ms, _policies_args(args, r))
    entry = {key: live.get(key) for key in ENTRY_KEYS}
    entry.update(workload=r.workload, seed=args.seed, policy=r.label, table="km", model=MODEL, repeats=len(results),
                 errors=live.get("errors"), keysmanager=r.keysmanager,
                 run_wall_s=statistics.fmean(x["wall_s"] for x in results),
                 replica_ready_lag_s=live.get("replica_ready_lag_s"))
    try:
        entry["live_costs"] = decompose([x for res in results for x in res["records"]],
                                        [v for res in results for v in res["lat"]], args.stages,
                                        nominal_stage_ms(args.stages))
    except ValueError:
        entry["live_costs"] = None
    if not args.no_sim:
        lags = [x for res in results for x in res["lags"]]
        arrivals = make_workload(r.workload, args.rate, args.duration, args.seed, args.trace)
        lag = statistics.median(lags) if lags else None
        entry["sim"] = simulated(args, r.policy, r.replicas, arrivals, costs, lag)
        entry["sim_over_live"] = _over(entry["sim"], entry)
        if entry["live_costs"]:  # the same run simulated with its own measured costs: what the cost prediction misses
            entry["sim_own_costs"] = simulated(args, r.policy, r.replicas, arrivals, entry["live_costs"], lag)
            entry["sim_own_costs_over_live"] = _over(entry["sim_own_costs"], entry)
    print(f"[{r.workload}] {r.label}: mean {entry['mean_ms']:.0f} ms, p99 {entry['p99_ms']:.0f} ms, "
          f"replica-s {entry['replica_seconds']:.0f}"
          + (f"; sim mean {entry['sim']['mean_ms']:.0f} p99 {entry['sim']['p99_ms']:.0f}" if "sim" in entry else "")
          + (f"; with its own costs {entry['sim_own_costs']['mean_ms']:.0f} / {entry['sim_own_costs']['p99_ms']:.0f}"
             if "sim_own_costs" in entry else ""),
          file=sys.stderr)
    return entry


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from quart_tools.report import json_safe

    try:
        if args.dry_run:
            runs, _ = planned(args)
            print(format_plan(runs, args.duration, Overheads()))
            return 0
        write_report(json_safe(run(args)), args.out)
    except (RuntimeError, ValueError, OSError) as exc:  # OSError: a missing --trace file, among others
        print(f"quartctl bench frontier: {exc}", file=sys.stderr)
        return 1
    return 0
