"""The run list of `quartctl bench frontier` and its wall time, before anything runs (``--dry-run``).

Pure: the runs (workload × repeat × policy label, in the rotated order the bench executes them), the static-k
that bracket QUART's replica-seconds (``bracket_k``: static-k spends k × stages × duration, so QUART's
interpolated frontier point needs only the k below and above it), and the wall-time arithmetic: per run the
arrivals plus the measured overheads (reset to the start replicas, settle, drain, timeline read), once the
gateway start and the hop-cost calibration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PlannedRun:
    """One live run of the frontier bench."""

    workload: str
    label: str  # the entry's policy: "quart", "openfaas-ce", "openfaas-ce+km", "static-3"
    policy: str  # the policy the plugin runs
    replicas: int  # replicas per stage at the start (static-k: k)
    keysmanager: bool  # com.quart.keysmanager on the stage functions
    repeat: int


@dataclass(frozen=True)
class Overheads:
    """Seconds beside the arrivals (measured: docs/benchmarks.md, "Live frontier")."""

    per_run_s: float = 5.0  # reset to the start replicas + settle + drain + timeline: 3.3-4.4 s per run measured
    gateway_start_s: float = 20.0  # partition + `quartctl up`, once
    calibration_s: float = 45.0  # the hop-cost phases (idle + loaded) before the runs, once: 44 s measured
    drain_bound_s: float = 30.0  # at most this more per baseline run whose queue outlasts its arrivals (the timeout)


def labels(policies: list[str], static_k: list[int], baselines_keysmanager: str, start_replicas: int) -> list[tuple]:
    """(label, policy, replicas, keysmanager) of one workload's runs: QUART and the baselines (without the KeysManager
    as the paper ran them, ``+km`` with it, or both), then static-k (with the KeysManager, as QUART)."""
    if baselines_keysmanager not in ("off", "on", "both"):
        raise ValueError(f"--baselines-keysmanager: off, on or both, not {baselines_keysmanager!r}")
    out = []
    for p in policies:
        if p == "quart":
            out.append(("quart", "quart", start_replicas, True))
            continue
        if baselines_keysmanager in ("off", "both"):
            out.append((p, p, start_replicas, False))
        if baselines_keysmanager in ("on", "both"):
            out.append((f"{p}+km", p, start_replicas, True))
    return out + [(f"static-{k}", "static", k, True) for k in static_k]


def plan_runs(workloads: list[str], policies: list[str], static_k: dict[str, list[int]], repeats: int,
              baselines_keysmanager: str = "off", start_replicas: int = 1) -> list[PlannedRun]:
    """Every run in execution order: per workload, ``repeats`` rounds, each round's order rotated by one."""
    runs = []
    for w in workloads:
        kinds = labels(policies, static_k[w], baselines_keysmanager, start_replicas)
        for rep in range(repeats):
            order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
            runs += [PlannedRun(w, label, policy, k, km, rep) for label, policy, k, km in order]
    return runs


def wall_time_s(runs: int, duration_s: float, overheads: Overheads, side_by_side: int = 1) -> float:
    """Seconds of the whole bench: arrivals + per-run overheads, ``side_by_side`` runs at once, plus the set-up."""
    per = duration_s + overheads.per_run_s
    return math.ceil(runs / max(1, side_by_side)) * per + overheads.gateway_start_s + overheads.calibration_s


def bracket_k(replica_seconds: float, stages: int, duration_s: float, k_max: int, margin: float = 0.1) -> list[int]:
    """The static-k whose costs (k × stages × duration) bracket ``replica_seconds``; with a neighbour more on the
    side it lies within ``margin`` (of one k) of, so a prediction that is a little off still falls inside."""
    if not math.isfinite(replica_seconds) or replica_seconds <= 0 or stages <= 0 or duration_s <= 0:
        raise ValueError(f"cannot bracket replica-seconds {replica_seconds!r}")
    x = replica_seconds / (stages * duration_s)  # QUART's mean replicas per stage
    lo, hi = max(1, math.floor(x)), max(1, math.ceil(x))
    if hi == lo:
        hi = lo + 1
    if x - lo < margin:
        lo -= 1
    if hi - x < margin:
        hi += 1
    return list(range(max(1, lo), min(k_max, hi) + 1))


def format_plan(runs: list[PlannedRun], duration_s: float, overheads: Overheads, side_by_side: int = 1) -> str:
    """The run list (one line per workload and round) and the wall-time arithmetic, as text."""
    lines = []
    for w in dict.fromkeys(r.workload for r in runs):
        for rep in sorted({r.repeat for r in runs if r.workload == w}):
            mine = [r.label for r in runs if r.workload == w and r.repeat == rep]
            lines.append(f"{w} round {rep + 1}: {len(mine)} runs: {', '.join(mine)}")
    total = wall_time_s(len(runs), duration_s, overheads, side_by_side)
    arrivals = len(runs) * duration_s
    baselines = sum(1 for r in runs if r.policy not in ("quart", "static"))
    bound = total + baselines * overheads.drain_bound_s / max(1, side_by_side)
    lines.append(f"{len(runs)} runs x {duration_s:g} s = {arrivals:,.0f} s of arrivals ({arrivals / 3600:.2f} h); "
                 f"+ {overheads.per_run_s:g} s per run (reset, settle, drain), + {overheads.gateway_start_s:g} s start "
                 f"+ {overheads.calibration_s:g} s calibration"
                 + (f", {side_by_side} runs side by side" if side_by_side > 1 else "")
                 + f" = {total:,.0f} s ({total / 60:.0f} min, {total / 3600:.2f} h)"
                 + (f"; at most {bound:,.0f} s ({bound / 60:.0f} min) if each of the {baselines} baseline runs drains "
                    f"for {overheads.drain_bound_s:g} s" if baselines else ""))
    return "\n".join(lines)
