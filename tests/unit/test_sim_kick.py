"""The traffic kick in the simulator: the live Controller's kicked decision, on simulated time (gateway_plugin.kick)."""

from __future__ import annotations

import numpy as np
import pytest
from gateway_plugin.policies import make_policy
from quart_tools.arrivals import Arrivals, poisson_arrivals
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec

MB = 1_000_000


def _sim(arrivals: Arrivals, policy: str = "quart", kick: bool = True, **policy_config) -> Simulation:
    stages = tuple(StageSpec(f"m-{i}", 0.02, 10 * MB) for i in range(3))  # μ = 50 req/s per replica
    cfg = SimConfig(model="m", stages=stages, slo_s=0.2, calibration=Calibration(hosts=4, gpus_per_host=8),
                    max_replicas=10, drain_s=5.0, seed=1, kick=kick)
    sim = Simulation(cfg, make_policy(policy, **policy_config), arrivals)
    sim.control.controller.keep_timeline = True
    return sim


def _first_scale_up(sim: Simulation) -> dict:
    return next(row for row in sim.control.controller.timeline if row["desired"][0] > 1)


def test_a_burst_from_idle_is_decided_before_the_first_tick() -> None:
    arrivals = poisson_arrivals(200.0, 10.0, seed=3)  # 4 × what one replica per stage serves, from t = 0
    kicked, ticked = _sim(arrivals), _sim(arrivals, kick=False)
    with_kick, without = kicked.run(), ticked.run()
    first, first_tick = _first_scale_up(kicked), _first_scale_up(ticked)
    assert first["kicked"] and 0.5 <= first["time"] < 1.0, first  # once kick_min_span_s of traffic is seen
    assert not first_tick["kicked"] and first_tick["time"] == pytest.approx(1.0)
    assert with_kick.kicks >= 1 and without.kicks == 0
    early = arrivals.times < 2.0  # the requests that met the single replicas are served sooner
    assert np.nanmean(with_kick.latencies_ms[early]) < 0.8 * np.nanmean(without.latencies_ms[early])


def test_kicks_are_rare_in_steady_traffic_and_the_policy_is_not_told() -> None:
    arrivals = poisson_arrivals(60.0, 60.0, seed=5)  # within what two replicas per stage serve
    res = _sim(arrivals, "static", replicas=2).run()
    assert res.kicks == 0


def test_a_storm_gets_at_most_one_kicked_decision_per_interval() -> None:
    # the rate doubles every 0.5 s (25 → 1 600 req/s); static-1 never follows, so every step re-arms at 2 × the rate
    times = np.concatenate([k * 0.5 + np.sort(np.random.default_rng(k).uniform(0, 0.5, int(25 * 2**k * 0.5)))
                            for k in range(7)])
    sim = _sim(Arrivals(times, np.full(len(times), 64, dtype=np.int64)), "static", replicas=1)
    res = sim.run()
    rows = list(sim.control.controller.timeline)
    kicked = [row["time"] for row in rows if row["kicked"]]
    assert res.kicks == len(kicked) >= 3
    interval = sim.control.controller.config.kick_min_interval_s
    for before, row in zip(rows, rows[1:], strict=False):
        if row["kicked"]:
            assert row["time"] - before["time"] >= interval - 1e-9, (before["time"], row["time"])
    assert len(kicked) <= times[-1] / interval + 1
