"""QUART's parts one at a time (issue 15, item 2): the full policy, then without each part, on the same workloads.

Variants (everything else as `quartctl simulate --experiment frontier` runs QUART: KeysManager, cache-aware
placer, provisioning corrector):

| variant | what is removed |
|---|---|
| `quart` | nothing |
| `-smooth` | Smooth (§5.2): no reclaiming by CV-weighted neighbour demand |
| `-cpu` | CPU compensation (§5.3): QUART's CPU regression is fitted on the simulated replicas (`cpu_seconds` shows what it spends) |
| `+cpu-allocate` | (added, not removed) AllocateCPU also on stages over target that Correct cannot grow (`CPUConfig.allocate`) |
| `-key-placement` | key-stage placement: the cache-blind first-fit placer instead of the cache-aware one |
| `-keysmanager` | the KeysManager: every new replica is a cold start |
| `pid` | the provisioning corrector: the paper's PID Correct instead (QUART before issue 15) |

With a frontier document (``frontier``), each row also reads the static frontier at the variant's cost.
"""

from __future__ import annotations

import json
from dataclasses import replace

from quart_tools.sim.calibration import Calibration
from quart_tools.sim.experiments import RunSpec, rate_for
from quart_tools.sim.frontier import _pool, _run_job, frontier_at, frontier_points, workloads

VARIANTS: dict[str, tuple[str, dict, tuple[tuple[str, object], ...]]] = {
    "quart": ("quart", {}, ()),
    "-smooth": ("quart", {"smooth": {"enabled": False}}, ()),
    "-cpu": ("quart", {"cpu": {"enabled": False}}, ()),
    "+cpu-allocate": ("quart", {"cpu": {"allocate": True}}, ()),
    "-key-placement": ("quart", {}, (("placer", "first-fit"),)),
    "-keysmanager": ("quart-no-km", {}, ()),
    "pid": ("quart", {"mode": "pid"}, ()),
}


def run_ablation(models: list[str], cvs: list[float], duration_s: float, load: float, calibration: Calibration,
                 trace_path: str | None, seeds: list[int] | int = 0, workers: int | None = None,
                 frontier: list[dict] | None = None, overrides: tuple[tuple[str, object], ...] = ()) -> dict:
    """Every variant on every workload; rows with mean, p99, replica-seconds and, given a frontier document's
    entries, the static frontier at the variant's cost."""
    jobs = []
    seeds = [seeds] if isinstance(seeds, int) else list(seeds)
    for w, seed in ((w, seed) for w in workloads(models, cvs, trace_path is not None) for seed in seeds):
        base = RunSpec(w.model, "quart", w.arrivals, rate_for(w.model, load, calibration), w.cv, duration_s, seed,
                       calibration, trace_path or "", overrides, tag=w.name)
        for label, (system, config, extra) in VARIANTS.items():
            jobs.append((label, "km", replace(base, system=system, policy_config=json.dumps(config) if config else "",
                                              overrides=base.overrides + extra)))
    entries = _pool(_run_job, jobs, workers, "quart ablation", lambda j: j[2].rate * j[2].duration_s)
    rows = []
    for e in entries:
        row = {k: e.get(k) for k in ("workload", "seed", "policy", "mean_ms", "p99_ms", "replica_seconds", "cpu_seconds")}
        if frontier:
            mine = [f for f in frontier if f["workload"] == e["workload"] and f["table"] == "km"
                    and f.get("seed", 0) == e["seed"]]
            front, how = frontier_at(frontier_points(mine), e["replica_seconds"])
            row["frontier_mean_ms"], row["frontier"] = front, how
            row["over_frontier"] = e["mean_ms"] / front if front else None
        rows.append(row)
    return {"variants": list(VARIANTS), "rows": rows}
