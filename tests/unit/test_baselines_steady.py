"""Every baseline keeps a steady Poisson load (issue 32, item 6): on the simulated paper cluster, BERT-21B at 10 % of
what the cluster sustains, 90 s, its mean latency is within 2× the static frontier at its own replica-seconds.
With the KeysManager (forks) and as the paper ran them (cold starts), except INFless without it: see the last test."""

from __future__ import annotations

import numpy as np
import pytest
from quart_tools.arrivals import poisson_arrivals
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.experiments import rate_for
from quart_tools.sim.frontier import frontier_at, frontier_points
from quart_tools.sim.oracle import served_replica_seconds
from quart_tools.sim.scenario import BASELINES, run

MODEL, LOAD, DURATION_S = "bert-21b", 0.1, 90.0


@pytest.fixture(scope="module")
def steady():
    cal = Calibration()
    arrivals = poisson_arrivals(rate_for(MODEL, LOAD, cal), DURATION_S, seed=0)
    statics = []
    for k in (1, 2, 3):
        entry, result = run(MODEL, "static+km", arrivals, cal, policy_config={"replicas": k}, seed=0)
        statics.append({"policy": f"static-{k}", "replica_seconds": served_replica_seconds(result),
                        "mean_ms": entry["mean_ms"]})
    return cal, arrivals, frontier_points(statics)


def _over_frontier(steady, system: str) -> tuple[float, float, float]:
    cal, arrivals, points = steady
    entry, result = run(MODEL, system, arrivals, cal, seed=0)
    cost = served_replica_seconds(result)
    front, _ = frontier_at(points, cost)
    assert front is not None, f"{system} spent {cost:.0f} replica-s, less than static-1"
    assert entry["rejected"] == 0 and not np.isnan(result.latencies_ms).any()
    return entry["mean_ms"] / front, entry["mean_ms"], cost


@pytest.mark.parametrize("system", [f"{b}+km" for b in BASELINES] + [b for b in BASELINES if b != "infless"])
def test_baseline_keeps_a_steady_poisson_load_within_2x_the_static_frontier(steady, system: str) -> None:
    ratio, mean, cost = _over_frontier(steady, system)
    assert ratio <= 2.0, f"{system}: {mean:.0f} ms at {cost:.0f} replica-s = {ratio:.2f}× the static frontier"


def test_infless_without_the_keysmanager_pays_its_whole_model_cold_start(steady) -> None:
    """INFless as the paper ran it serves the model as one function: one instance (8 GPUs) serves one request at a
    time, 1 / (8 × 17 ms) ≈ 7.3 req/s, against 35 req/s here; its first scale-up is a 45 s cold start of the whole
    model from disk, so the backlog of the first 45 s (beyond the queue cap: rejected) dominates a 90 s run. With the
    KeysManager (a fork) the same policy keeps the load (the test above)."""
    cal, arrivals, _ = steady
    entry, _ = run(MODEL, "infless", arrivals, cal, seed=0)
    km, _ = run(MODEL, "infless+km", arrivals, cal, seed=0)
    assert entry["mean_ms"] > 20 * km["mean_ms"]
