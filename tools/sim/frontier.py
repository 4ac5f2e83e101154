"""Latency at equal cost (issue 15): every policy on the same simulated data plane, the static frontier, the oracle.

Per workload (a paper model × gamma CV, or × the trace replay): QUART, every baseline and
``static-1`` … ``static-k`` run with the KeysManager and the cache-aware placer (the main table), the
baselines also as the paper ran them, without it (the second table); then the clairvoyant oracle
(`quart_tools.sim.oracle`) at QUART's replica-seconds. The summary reads each workload at QUART's cost:
the static frontier (the Pareto envelope of the static-k points, linear between them) interpolated at
QUART's replica-seconds, QUART against every baseline that spends no more, and QUART against the oracle; every
workload runs once per seed, and ``over_seeds`` gives the mean and the worst per workload (issue 32).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, replace
from multiprocessing import get_context

from quart_tools.arrivals import TRACE_WINDOWS
from quart_tools.sim.calibration import PAPER_STAGES, Calibration
from quart_tools.sim.experiments import RunSpec, _arrivals, rate_for
from quart_tools.sim.oracle import ORACLE_TOLERANCE, run_oracle, served_replica_seconds
from quart_tools.sim.scenario import BASELINES, run, sim_config, system

QUICK_DURATION_S = 30.0
TARGETS = {"frontier": 1.0, "oracle": 1.3}  # the issue's: QUART ≤ 1.0× the frontier, ≤ 1.3× the oracle
SEED_TARGETS = {"frontier_mean": 1.0, "frontier_worst": 1.1, "oracle_worst": 1.15}  # issue 32, over ≥ 5 seeds
ENTRY_KEYS = ("workload", "seed", "policy", "table", "model", "mean_ms", "p99_ms", "slo_attainment", "replica_seconds",
              "gpu_seconds", "cpu_seconds", "rejected")


@dataclass(frozen=True)
class Workload:
    model: str
    arrivals: str  # "gamma" | "trace-busy" | "trace-quiet" | "trace-step" (quart_tools.arrivals.trace_window)
    cv: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.model}/{self.arrivals if self.arrivals.startswith('trace') else f'cv{self.cv:g}'}"


def workloads(models: list[str], cvs: list[float], trace: bool) -> list[Workload]:
    """Per model: gamma arrivals at each CV, then (``trace``) the trace's busiest, quietest and rate-step windows,
    each replayed at its own time scale (no loop, no compression) with the rate matched to the load."""
    out = []
    for m in models:
        out += [Workload(m, "gamma", cv) for cv in cvs]
        if trace:
            out += [Workload(m, f"trace-{kind}") for kind in TRACE_WINDOWS]
    return out


def static_max(calibration: Calibration, stages: int, max_replicas: int) -> int:
    """The largest k the cluster holds on every stage at once (beyond it static-k leaves asks unplaced)."""
    per_stage = calibration.hosts * calibration.gpus_per_host // stages
    return min(per_stage, max_replicas) if max_replicas else per_stage


def plan(loads: list[Workload], duration_s: float, load: float, calibration: Calibration, trace_path: str,
         seeds: list[int], k_max: int, overrides: tuple[tuple[str, object], ...]) -> list[tuple[str, str, RunSpec]]:
    """(policy label, table, run) for every workload and seed: QUART, baselines and static-k with the
    KeysManager ("km"), the baselines without it ("no-km")."""
    runs = []
    for w, seed in ((w, seed) for w in loads for seed in seeds):
        base = RunSpec(w.model, "quart", w.arrivals, rate_for(w.model, load, calibration), w.cv, duration_s, seed,
                       calibration, trace_path, overrides, tag=w.name)
        runs.append(("quart", "km", base))
        runs += [(b, "km", replace(base, system=f"{b}+km")) for b in BASELINES]
        runs += [(f"static-{k}", "km", replace(base, system="static+km", policy_config=json.dumps({"replicas": k})))
                 for k in range(1, k_max + 1)]
        runs += [(b, "no-km", replace(base, system=b)) for b in BASELINES]
    return runs


def slim(entry: dict, workload: str, policy: str, table: str, seed: int) -> dict:
    """The experiment's entry: the issue's keys plus the seed, the table, the model and the GPU slot time."""
    out = {**entry, "workload": workload, "seed": seed, "policy": policy, "table": table}
    return {k: out.get(k) for k in ENTRY_KEYS}


def _run_job(job: tuple[str, str, RunSpec]) -> dict:
    """Worker: one policy on one workload, its cost measured while the workload is served."""
    label, table, spec = job
    config = json.loads(spec.policy_config) if spec.policy_config else None
    entry, result = run(spec.model, spec.system, _arrivals(spec), spec.calibration, policy_config=config,
                        seed=spec.seed, **dict(spec.overrides))
    entry["replica_seconds"] = served_replica_seconds(result)
    return slim(entry, spec.tag, label, table, spec.seed)


def _oracle_job(job: tuple[RunSpec, float]) -> dict:
    """Worker: the oracle for one workload at ``budget`` replica-seconds (QUART's)."""
    spec, budget = job
    cfg = sim_config(spec.model, system("quart"), spec.calibration, seed=spec.seed, **dict(spec.overrides))
    result = run_oracle(cfg, _arrivals(spec), budget, cfg.max_replicas or _cap(cfg), tolerance=ORACLE_TOLERANCE)
    entry = slim(result.entry, spec.tag, "oracle", "km", spec.seed)
    entry["oracle"] = {"budget_replica_seconds": budget, "window_s": result.schedule.window_s, "runs": result.runs,
                       "cost_over_budget": entry["replica_seconds"] / budget if budget else None}
    return entry


def _cap(cfg) -> int:
    cal = cfg.calibration
    return max(1, 2 * cal.hosts * cal.gpus_per_host // len(cfg.stages))


def _pool(fn, jobs: list, workers: int | None, desc: str, cost) -> list[dict]:
    """``fn`` over ``jobs`` on ``workers`` processes (default: all cores), dearest first; results in job order."""
    order = sorted(range(len(jobs)), key=lambda i: -cost(jobs[i]))
    workers = min(workers or os.cpu_count() or 1, max(1, len(jobs)))
    out: list[dict | None] = [None] * len(jobs)
    with get_context("fork").Pool(workers) as pool:
        for n, (i, r) in enumerate(zip(order, pool.imap(fn, [jobs[i] for i in order]), strict=True), 1):
            out[i] = r
            if n % max(1, len(jobs) // 20) == 0 or n == len(jobs):
                print(f"{desc}: {n}/{len(jobs)}", file=sys.stderr, flush=True)
    return [r for r in out if r is not None]


def _key(e: dict) -> tuple:
    return e["workload"], e.get("seed", 0), e["policy"], e["table"]


def run_frontier(models: list[str], cvs: list[float], duration_s: float, load: float, calibration: Calibration,
                 trace_path: str | None, seeds: list[int] | int = 0, workers: int | None = None,
                 overrides: tuple[tuple[str, object], ...] = (), reuse: list[dict] | None = None) -> dict:
    """The whole experiment: entries (main table "km", second table "no-km", the oracle; each with its seed), the
    summary per (workload, seed) and ``over_seeds`` (mean and worst per workload).

    ``reuse``: entries of an earlier run of the same configuration; its baseline and static-k entries are taken
    as they are (runs are deterministic per seed; only QUART and the oracle at QUART's cost are run again)."""
    seeds = [seeds] if isinstance(seeds, int) else list(seeds)
    loads = workloads(models, cvs, trace_path is not None)
    if not loads:
        raise ValueError("no workload: give --cvs or a trace")
    max_replicas = int(dict(overrides).get("max_replicas", 0))
    k_max = static_max(calibration, PAPER_STAGES, max_replicas)
    runs = plan(loads, duration_s, load, calibration, trace_path or "", seeds, k_max, overrides)
    kept = {_key(e): e for e in reuse or [] if e["policy"] not in ("quart", "oracle")}
    todo = [r for r in runs if (r[2].tag, r[2].seed, r[0], r[1]) not in kept]
    done = _pool(_run_job, todo, workers, "frontier runs", lambda r: r[2].rate * r[2].duration_s) if todo else []
    fresh = {_key(e): e for e in done}
    entries = [fresh.get(k) or kept[k] for k in ((r[2].tag, r[2].seed, r[0], r[1]) for r in runs)]
    quart = {(e["workload"], e["seed"]): e for e in entries if e["policy"] == "quart"}
    jobs = [(spec, quart[spec.tag, spec.seed]["replica_seconds"]) for label, _, spec in runs if label == "quart"]
    entries += _pool(_oracle_job, jobs, workers, "frontier oracles", lambda j: j[0].rate * j[0].duration_s)
    summary = summarise(entries)
    return {"entries": entries, "summary": summary, "over_seeds": over_seeds(summary), "static_k_max": k_max}


# ------------------------------------------------------------------------------------- summary


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def frontier_points(entries: list[dict]) -> list[tuple[float, float]]:
    """(replica-seconds, mean) of the static-k runs, by cost."""
    pts = [(e["replica_seconds"], e["mean_ms"]) for e in entries
           if e["policy"].startswith("static-") and _finite(e["replica_seconds"]) and _finite(e["mean_ms"])]
    return sorted(pts)


def frontier_at(points: list[tuple[float, float]], cost: float) -> tuple[float | None, str]:
    """The static frontier's mean at ``cost``: the Pareto envelope (no point dearer and slower), linear
    between its points; None below the cheapest; the dearest point's mean above it ("clamped")."""
    env: list[tuple[float, float]] = []
    for c, m in points:
        if not env or m < env[-1][1]:
            env.append((c, m))
    if not env or cost < env[0][0]:
        return None, "below the cheapest static"
    for (c0, m0), (c1, m1) in zip(env, env[1:], strict=False):
        if c0 <= cost <= c1:
            return m0 + (m1 - m0) * (cost - c0) / (c1 - c0) if c1 > c0 else m1, "interpolated"
    return env[-1][1], "clamped" if cost > env[-1][0] else "interpolated"


def _ratio(a, b) -> float | None:
    return a / b if _finite(a) and _finite(b) and b > 0 else None


def summarise(entries: list[dict]) -> list[dict]:
    """Per workload, QUART at its own cost against the frontier, the cheaper-or-equal baselines, the oracle."""
    rows = []
    for workload, seed in dict.fromkeys((e["workload"], e.get("seed", 0)) for e in entries):
        mine = [e for e in entries if e["workload"] == workload and e.get("seed", 0) == seed]
        by = {(e["policy"], e["table"]): e for e in mine}
        q = by.get(("quart", "km"))
        if q is None:
            continue
        cost, mean = q["replica_seconds"], q["mean_ms"]
        front, how = frontier_at(frontier_points([e for e in mine if e["table"] == "km"]), cost)
        cheaper = {f"{e['policy']}{'' if e['table'] == 'km' else ' (no-km)'}": {
            "mean_ms": e["mean_ms"], "replica_seconds": e["replica_seconds"],
            "quart_over": _ratio(mean, e["mean_ms"])}
            for e in mine if e["policy"] in BASELINES and _finite(e["replica_seconds"])
            and e["replica_seconds"] <= cost}
        oracle = by.get(("oracle", "km"))
        row = {
            "workload": workload, "seed": seed,
            "quart_mean_ms": mean, "quart_p99_ms": q["p99_ms"], "quart_replica_seconds": cost,
            "frontier_mean_ms": front, "frontier": how, "quart_over_frontier": _ratio(mean, front),
            "cheaper_baselines": cheaper,
            "below_every_cheaper_baseline": all(_finite(mean) and (not _finite(b["mean_ms"]) or mean < b["mean_ms"])
                                                for b in cheaper.values()),
            "oracle_mean_ms": oracle and oracle["mean_ms"],
            "oracle_replica_seconds": oracle and oracle["replica_seconds"],
            "oracle_cost_over_budget": oracle and oracle["oracle"]["cost_over_budget"],
            "quart_over_oracle": _ratio(mean, oracle and oracle["mean_ms"]),
            "oracle_over_frontier": _ratio(oracle and oracle["mean_ms"], front),
        }
        row["targets_met"] = {
            "frontier": row["quart_over_frontier"] is not None and row["quart_over_frontier"] <= TARGETS["frontier"],
            "cheaper_baselines": row["below_every_cheaper_baseline"],
            "oracle": row["quart_over_oracle"] is not None and row["quart_over_oracle"] <= TARGETS["oracle"],
        }
        rows.append(row)
    return rows


def over_seeds(rows: list[dict]) -> list[dict]:
    """Per workload over its seeds: mean and worst (largest) of QUART / frontier and QUART / oracle, and the
    issue-32 targets: mean ≤ 1.0 × the frontier, worst ≤ 1.1 ×, worst QUART / oracle ≤ 1.15 ×, below every
    cheaper-or-equal baseline on every seed."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        agg: dict = {"workload": workload, "seeds": [r["seed"] for r in mine]}
        for key in ("quart_over_frontier", "quart_over_oracle", "oracle_over_frontier"):
            vals = [r[key] for r in mine if _finite(r[key])]
            agg[f"{key}_mean"] = sum(vals) / len(vals) if vals else None
            agg[f"{key}_worst"] = max(vals) if vals else None
            agg[f"{key}_by_seed"] = {str(r["seed"]): r[key] for r in mine}
        agg["worst_seed"] = max(mine, key=lambda r: r["quart_over_frontier"] or math.inf)["seed"]
        complete = all(_finite(r["quart_over_frontier"]) and _finite(r["quart_over_oracle"]) for r in mine)
        agg["targets_met"] = {
            "frontier_mean": complete and agg["quart_over_frontier_mean"] <= SEED_TARGETS["frontier_mean"],
            "frontier_worst": complete and agg["quart_over_frontier_worst"] <= SEED_TARGETS["frontier_worst"],
            "oracle_worst": complete and agg["quart_over_oracle_worst"] <= SEED_TARGETS["oracle_worst"],
            "cheaper_baselines": all(r["below_every_cheaper_baseline"] for r in mine),
        }
        out.append(agg)
    return out
