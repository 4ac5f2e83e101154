"""The paper's evaluation on the simulated cluster: Fig. 2, 6, 7, 8, the summary table, ablations.

Every experiment is a list of independent runs (model × arrivals × system) spread over the cores
with multiprocessing; each run returns one report entry (the keys shared with the live benchmark).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing import get_context

import numpy as np
from gateway_plugin.policies import POLICY_NAMES
from quart_tools.arrivals import (
    DEFAULT_TRACE,
    TRACE_WINDOWS,
    gamma_arrivals,
    load_trace,
    pick_window,
    replay_trace,
    trace_window,
)
from quart_tools.report import latency_stats
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.scenario import BASELINES, pipeline_capacity_rps, run
from tqdm import tqdm

FIG7_CVS = (0.1, 1.0, 2.0, 4.0, 8.0)
FIG7_SYSTEMS = POLICY_NAMES  # QUART and every baseline
PAPER_BASELINES = ("infless", "inferline", "cocktail")  # the three the paper compares against
ABLATIONS = ("quart", "quart-no-km", *(f"{b}+km" for b in PAPER_BASELINES), *PAPER_BASELINES)

# QUART §8 (and ../shared/design/ALGORITHMS.md): what the paper reports.
PAPER_REPORTED = {
    "trace_mean_latency_reduction": {"infless": 0.871, "inferline": 0.705, "cocktail": 0.367},
    "trace_slo_1.5_quart": 0.475,
    "trace_slo_1.5_ratio": {"infless": 2.19, "inferline": 2.37, "cocktail": 2.09},
    "cv_mean_latency_reduction": {"infless": 0.698, "inferline": 0.772, "cocktail": 0.478},
    "cv_goodput_ratio": {"infless": 13.5, "inferline": 14.4, "cocktail": 2.3},
    "cv8_goodput_ratio": {"infless": 17.9, "inferline": 32.4, "cocktail": 3.9},
    "infless_queue_ratio_max": 10.1,
}


@dataclass(frozen=True)
class RunSpec:
    """One simulated run, picklable for the worker pool."""

    model: str
    system: str
    arrivals: str  # "gamma" | "trace" (the whole trace, compressed, looped) | "trace-busy|quiet|step" (a window)
    rate: float
    cv: float = 1.0
    duration_s: float = 600.0
    seed: int = 0
    calibration: Calibration = field(default_factory=Calibration)
    trace_path: str = str(DEFAULT_TRACE)
    overrides: tuple[tuple[str, object], ...] = ()
    tag: str = ""
    policy_config: str = ""  # JSON object passed to make_policy (diagnostic variants)


TRACE_PEAK_OVER_MEAN = 2.0  # a trace window's busiest minute at most this × the target mean (load 0.4 → 0.8 of capacity)


def _arrivals(spec: RunSpec):
    if spec.arrivals == "gamma":
        return gamma_arrivals(spec.rate, spec.cv, spec.duration_s, seed=spec.seed)
    kind = spec.arrivals.removeprefix("trace-")
    if kind in TRACE_WINDOWS:  # a window of the trace at its own time scale, rate matched (no loop)
        trace = load_trace(spec.trace_path)
        start = pick_window(trace, kind, spec.duration_s)
        return trace_window(trace, start, spec.duration_s, spec.rate, seed=spec.seed,
                            peak_rate=TRACE_PEAK_OVER_MEAN * spec.rate)
    if spec.arrivals == "trace":
        return replay_trace(load_trace(spec.trace_path), target_rate=spec.rate, duration_s=spec.duration_s,
                            loop=True)
    raise ValueError(f"unknown arrivals {spec.arrivals!r}")


def run_spec(spec: RunSpec) -> dict:
    """Worker: simulate one run and return its report entry (no raw arrays)."""
    arrivals = _arrivals(spec)
    config = json.loads(spec.policy_config) if spec.policy_config else None
    entry, result = run(spec.model, spec.system, arrivals, spec.calibration, policy_config=config, seed=spec.seed,
                        **dict(spec.overrides))
    lat = result.latencies_ms[~np.isnan(result.latencies_ms)]
    entry["p90_ms"] = float(np.percentile(lat, 90)) if len(lat) else math.nan
    entry["p75_ms"] = latency_stats(lat)["p75_ms"]
    entry["target_cv"] = spec.cv if spec.arrivals == "gamma" else None
    entry["tag"] = spec.tag
    entry["queue_mean"] = float(np.mean(list(entry["queue_mean_by_stage"].values()))) if entry["queue_mean_by_stage"] else 0.0
    return entry


def run_many(specs: list[RunSpec], workers: int | None = None, desc: str = "runs") -> list[dict]:
    """Run specs over ``workers`` processes (default: all cores); results in spec order."""
    workers = workers or os.cpu_count() or 1
    # Longest runs first so the pool does not end on one straggler.
    order = sorted(range(len(specs)), key=lambda i: -_cost(specs[i]))
    results: list[dict | None] = [None] * len(specs)
    tty = sys.stderr.isatty()
    bar = tqdm(total=len(specs), desc=desc, unit="run", file=sys.stderr, disable=not tty)
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        bar.update(1)
        if not tty and (done % max(1, len(specs) // 20) == 0 or done == len(specs)):
            print(f"{desc}: {done}/{len(specs)} runs", file=sys.stderr, flush=True)

    try:
        if workers <= 1:
            for i in order:
                results[i] = run_spec(specs[i])
                advance()
        else:
            with get_context("fork").Pool(workers) as pool:
                for i, entry in zip(order, pool.imap(run_spec, [specs[i] for i in order]), strict=True):
                    results[i] = entry
                    advance()
    finally:
        bar.close()
    return [r for r in results if r is not None]


def _cost(spec: RunSpec) -> float:
    """Relative cost of a run: stage visits ∝ rate × duration (QUART also pays for its placer)."""
    return spec.rate * spec.duration_s * (2.0 if spec.system.startswith("quart") else 1.0)


def rate_for(model: str, load: float, calibration: Calibration) -> float:
    """Mean request rate = ``load`` × what the whole cluster sustains for this model."""
    return load * pipeline_capacity_rps(model, calibration)


# ------------------------------------------------------------------------------- experiments


def fig7_specs(models: Iterable[str], cvs: Iterable[float], systems: Iterable[str], duration_s: float,
               load: float, calibration: Calibration, seed: int = 0, policy_config: str = "",
               overrides: tuple[tuple[str, object], ...] = ()) -> list[RunSpec]:
    return [
        RunSpec(m, s, "gamma", rate_for(m, load, calibration), cv, duration_s, seed, calibration, tag="fig7",
                policy_config=policy_config if s.startswith("quart") else "", overrides=overrides)
        for m in models for cv in cvs for s in systems
    ]


def fig6_specs(models: Iterable[str], systems: Iterable[str], duration_s: float, load: float,
               calibration: Calibration, trace_path: str, seed: int = 0, policy_config: str = "",
               overrides: tuple[tuple[str, object], ...] = ()) -> list[RunSpec]:
    return [
        RunSpec(m, s, "trace", rate_for(m, load, calibration), 0.0, duration_s, seed, calibration, trace_path,
                tag="fig6", policy_config=policy_config if s.startswith("quart") else "", overrides=overrides)
        for m in models for s in systems
    ]


def fig2(calibration: Calibration, duration_s: float = 600.0, stages: int = 5, seed: int = 0) -> dict:
    """§3 case study: BERT-21B on ``stages`` stages, one replica each (5 A40s, no sharing), static.

    (a) CV of each stage's arrivals under CV = 1 input; (b) mean queue per stage under CV = 0.1.
    The rate loads each stage to 80 %.
    """
    from quart_tools.sim.scenario import model_stages

    specs = model_stages("bert-21b", stages)
    rate = 0.8 / specs[0].service_s
    out = {"stages": stages, "rate_rps": rate, "duration_s": duration_s, "runs": {}}
    for label, cv in (("a_cv1", 1.0), ("b_cv0.1", 0.1)):
        arrivals = gamma_arrivals(rate, cv, duration_s, seed=seed)
        entry, _ = run("bert-21b", "static", arrivals, calibration, policy_config={"replicas": 1},
                       stages=specs, initial_replicas=1, seed=seed)
        out["runs"][label] = {
            "input_cv": cv,
            "cv_by_stage": entry.get("cv_by_stage", {}),
            "queue_mean_by_stage": entry["queue_mean_by_stage"],
            "mean_ms": entry["mean_ms"],
        }
    a = list(out["runs"]["a_cv1"]["cv_by_stage"].values())
    b = list(out["runs"]["b_cv0.1"]["queue_mean_by_stage"].values())
    out["cv_max_over_min"] = max(a) / min(a) if a and min(a) > 0 else None
    out["queue_max_over_min"] = max(b) / min(b) if b and min(b) > 0 else None
    out["paper"] = {"cv_max_over_min": 3.5, "queue_max_over_min": 3.0}
    return out


# ------------------------------------------------------------------------------ summaries


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return None
    return a / b


def compare(entries: list[dict], group_keys: tuple[str, ...], baselines: Iterable[str] = PAPER_BASELINES,
            subject: str = "quart") -> dict:
    """``subject`` (QUART) against each baseline over the groups (model, or model × CV).

    Per baseline: mean over groups of the latency reduction 1 − subject/baseline; SLO@1.5 and
    goodput as ratios of their averages over the groups (a per-group ratio explodes where a baseline
    meets nothing); GPU-seconds ratio of totals; mean-queue ratio baseline/subject (mean and max).
    Per group: the subject against the *best* baseline (lowest mean latency among all baselines).
    """
    groups: dict[tuple, dict[str, dict]] = {}
    for e in entries:
        groups.setdefault(tuple(e[k] for k in group_keys), {})[e["policy"]] = e
    pairs: dict[str, list[tuple[dict, dict]]] = {}
    best_rows = []
    for g, by_policy in sorted(groups.items(), key=lambda kv: str(kv[0])):
        q = by_policy.get(subject)
        if q is None:
            continue
        for b in baselines:
            if b in by_policy:
                pairs.setdefault(b, []).append((q, by_policy[b]))
        candidates = [by_policy[b] for b in BASELINES if b in by_policy and _finite(by_policy[b]["mean_ms"])]
        if candidates:
            best = min(candidates, key=lambda e: e["mean_ms"])
            best_slo = max(candidates, key=lambda e: e["slo_attainment"]["1.5"] or 0.0)
            best_rows.append({
                "group": list(g),
                "best_baseline": best["policy"],
                "mean_ms": q["mean_ms"],
                "best_mean_ms": best["mean_ms"],
                "mean_ratio": _ratio(q["mean_ms"], best["mean_ms"]),
                "slo15_ratio": _ratio(q["slo_attainment"]["1.5"], best["slo_attainment"]["1.5"]),
                "gpu_seconds_ratio": _ratio(q["gpu_seconds"], best["gpu_seconds"]),
                "quart_slo15": q["slo_attainment"]["1.5"],
                "best_slo15": best["slo_attainment"]["1.5"],
                # The baseline that meets 1.5× most often (may differ from the lowest-mean one); "2×" of
                # an attainment above 0.5 exceeds 1 and cannot be reached.
                "best_slo_baseline": best_slo["policy"],
                "top_slo15": best_slo["slo_attainment"]["1.5"],
                "slo15_ratio_vs_top": _ratio(q["slo_attainment"]["1.5"], best_slo["slo_attainment"]["1.5"]),
                "slo_2x_reachable": (best_slo["slo_attainment"]["1.5"] or 0.0) <= 0.5,
                "quart_gpu_seconds": q["gpu_seconds"],
                "best_gpu_seconds": best["gpu_seconds"],
            })
    summary = {}
    for b, rows in pairs.items():
        red = [1.0 - r for q, e in rows if (r := _ratio(q["mean_ms"], e["mean_ms"])) is not None]
        queue = [r for q, e in rows if (r := _ratio(e["queue_mean"], q["queue_mean"])) is not None]

        def avg(key: str, sub: str | None = None, which: int = 0, rows=rows) -> float:
            vals = [(x[which][key][sub] if sub else x[which][key]) for x in rows]
            vals = [v for v in vals if _finite(v)]
            return float(np.mean(vals)) if vals else math.nan

        summary[b] = {
            "latency_reduction": float(np.mean(red)) if red else None,
            "slo15_ratio": _ratio(avg("slo_attainment", "1.5", 0), avg("slo_attainment", "1.5", 1)),
            "goodput_ratio": _ratio(avg("goodput_rps", None, 0), avg("goodput_rps", None, 1)),
            "gpu_seconds_ratio": _ratio(avg("gpu_seconds", None, 0), avg("gpu_seconds", None, 1)),
            "queue_ratio": float(np.mean(queue)) if queue else None,
            "queue_ratio_max": float(np.max(queue)) if queue else None,
            "subject_slo15": avg("slo_attainment", "1.5", 0),
            "baseline_slo15": avg("slo_attainment", "1.5", 1),
        }
    return {"subject": subject, "vs_baseline": summary, "vs_best_baseline": best_rows, "target": _target(best_rows)}


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _target(rows: list[dict]) -> dict:
    """The issue's target per group: mean ≤ 0.5× best, SLO@1.5 ≥ 2× best, GPU-seconds ≤ best."""
    met = []
    for r in rows:
        quart_slo, best_slo = r["quart_slo15"] or 0.0, r["best_slo15"] or 0.0
        slo_ok = quart_slo > 0 and quart_slo >= min(0.99, 2.0 * best_slo)  # "2×" caps at (almost) all
        met.append((r["mean_ratio"] is not None and r["mean_ratio"] <= 0.5, slo_ok,
                    r["gpu_seconds_ratio"] is not None and r["gpu_seconds_ratio"] <= 1.0))
    n = len(met)
    return {
        "groups": n,
        "mean_le_0.5x_best": sum(m[0] for m in met),
        "slo15_ge_2x_best": sum(m[1] for m in met),
        "gpu_seconds_le_best": sum(m[2] for m in met),
        "all_three": sum(all(m) for m in met),
    }


def fig8(entries: list[dict]) -> dict:
    """Latency quantiles and mean queue length per system and CV, averaged over models."""
    out: dict = {}
    for e in entries:
        row = out.setdefault(e["policy"], {}).setdefault(str(e["target_cv"]), {"p50_ms": [], "p75_ms": [],
                                                                                 "p90_ms": [], "p99_ms": [],
                                                                                 "queue_mean": []})
        for k in row:
            if e.get(k) is not None and math.isfinite(e[k]):
                row[k].append(e[k])
    return {p: {cv: {k: (float(np.mean(v)) if v else None) for k, v in row.items()} for cv, row in by_cv.items()}
            for p, by_cv in out.items()}


def ablation_table(entries: list[dict]) -> dict:
    """Per system, averaged over models: mean/p99 latency, SLO@1.5, GPU-seconds, fork/cold starts."""
    out: dict = {}
    for e in entries:
        row = out.setdefault(e["policy"], {"mean_ms": [], "p99_ms": [], "slo15": [], "gpu_seconds": [],
                                           "fork_starts": [], "cold_starts": []})
        for key, val in (("mean_ms", e["mean_ms"]), ("p99_ms", e["p99_ms"]), ("slo15", e["slo_attainment"]["1.5"]),
                         ("gpu_seconds", e["gpu_seconds"]), ("fork_starts", e["starts_by_source"]["fork"]),
                         ("cold_starts", e["starts_by_source"]["cold"])):
            if _finite(val):
                row[key].append(val)
    return {p: {k: (float(np.mean(v)) if v else None) for k, v in row.items()} for p, row in out.items()}


def timed(fn: Callable[[], dict]) -> dict:
    started = time.perf_counter()
    out = fn()
    out["wall_s"] = round(time.perf_counter() - started, 2)
    return out
