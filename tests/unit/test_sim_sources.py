"""Simulated scale-up sources (issues 16, 17): peer fetch, chain multicast, live (BlitzScale), ParaServe.

One stage on single-GPU hosts, the initial replica on host 0 (the only holder), a scripted scale-up: the new
replicas start from their mechanism's delay (Calibration), live replicas serve before they are fully loaded
and every request still finishes, ParaServe replicas serve as a sub-pipeline and then consolidate.
"""

from __future__ import annotations

import numpy as np
import pytest
from quart_tools.arrivals import Arrivals
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec
from support.scripted import Scripted

GB = 1_000_000_000
SIZE = 10 * GB


def _run(mechanisms: set[str], replicas: int = 4, rate: float = 40.0, service_s: float = 0.05, **cal_kw):
    cal = Calibration(hosts=8, gpus_per_host=1, service_cv=0.0, nic_gbytes_s=12.5, h2d_gbps=16.0,
                      disk_gbps=1.25, fork_fixed_s=0.05, cold_fixed_s=1.0, **cal_kw)
    cfg = SimConfig(model="m", stages=(StageSpec("m-stage-0", service_s, SIZE),), slo_s=1.0, calibration=cal,
                    hop_s=0.001, queue_cap=10**9, initial_replicas=1, prewarm_hosts=0, drain_s=60.0,
                    start_mechanisms=frozenset(mechanisms), paraserve_slo_s=4.0)
    n = int(rate * 20)
    arrivals = Arrivals(times=np.linspace(0.0, 20.0, n, endpoint=False), sizes=np.ones(n, dtype=np.int64))
    res = Simulation(cfg, Scripted([(0.0, 1), (1.0, replicas)]), arrivals).run()
    return cal, res


def _ready(res) -> list[float]:
    return sorted(r.ready_at - r.requested_at for r in res.launched)


def test_registry_cold_without_mechanisms_and_peer_fetch_sharing_one_source() -> None:
    cal, cold = _run(set())
    assert cold.starts_by_source["cold"] == 3
    assert _ready(cold) == [pytest.approx(cal.cold_s(SIZE))] * 3
    cal, peer = _run({"peer"})
    assert peer.starts_by_source["peer"] == 3
    # one holder: the three receivers share its NIC (a star), each transfer takes 3 × one
    assert _ready(peer) == [pytest.approx(cal.peer_s(SIZE, sharers=3))] * 3
    assert cal.peer_s(SIZE, 3) - cal.fork_s(SIZE) == pytest.approx(3 * SIZE / (12.5 * GB * cal.peer_efficiency))
    assert not np.isnan(peer.latencies_ms).any()


def test_multicast_last_receiver_is_about_one_transfer() -> None:
    cal, res = _run({"peer", "multicast"})
    ready = _ready(res)
    one = cal.peer_s(SIZE)
    assert ready[0] == pytest.approx(one)
    assert ready[-1] == pytest.approx(one + 2 * cal.chain_hop_bytes / cal.peer_rate())
    assert ready[-1] <= 1.01 * one  # the chain of 3 costs a few chunk times, not 3 transfers


def test_live_replicas_serve_before_they_hold_every_layer_and_lose_nothing() -> None:
    # 40 req/s on one 50 ms replica is overloaded (2×): the burst queues until the new replicas help
    cal, live = _run({"peer", "multicast", "live"})
    _, chain = _run({"peer", "multicast"})
    assert live.starts_by_source["live"] == 3
    for rep in live.launched:
        first, step, layers = cal.live_schedule(SIZE, 1, 1)
        assert rep.first_done < rep.ready_at  # served a prefix before the last layer arrived
        assert rep.ready_at - rep.requested_at <= chain.launched[0].ready_at - chain.launched[0].requested_at
    assert not np.isnan(live.latencies_ms).any() and live.rejected == 0
    assert np.percentile(live.latencies_ms, 99) < np.percentile(chain.latencies_ms, 99)
    assert np.mean(live.latencies_ms) < np.mean(chain.latencies_ms)


def test_live_needs_a_serving_replica_to_share_with() -> None:
    # the rule (starts.plan_starts) falls back to a chain without a replica of the stage that serves
    from quart_kernel.scheduling import Placement, plan_starts

    plans = plan_starts([Placement("f", "a", "peer")], {"f": ["s"]}, {"peer", "multicast", "live"}, {"f": 0})
    assert plans[0].mode == "peer"


def test_paraserve_splits_a_cold_start_and_consolidates() -> None:
    cal, res = _run({"paraserve"})
    assert res.starts_by_source["paraserve"] == 3
    parts, predicted, meets = res.paraserve_plans[0]
    assert parts == 3 and meets  # 10 GB at 10 Gbit/s: P = 1 takes 9.7 s, P = 2 5.3 s, P = 3 3.9 s: the smallest to meet 4 s
    first, consolidated = cal.paraserve_s(SIZE, 3)
    for rep in res.launched:
        assert rep.ready_at - rep.requested_at == pytest.approx(first)
        assert rep.consolidated_at - rep.requested_at == pytest.approx(consolidated)
    assert first < 0.45 * cal.cold_s(SIZE)  # 1 s of fixed start is not split
    assert not np.isnan(res.latencies_ms).any()


def test_legacy_runs_are_unchanged_by_the_new_sources() -> None:
    cal, res = _run(set())
    assert set(res.starts_by_source) == {"gpu", "fork", "cold"}
    with pytest.raises(ValueError, match="start_mechanisms"):
        SimConfig(model="m", stages=(StageSpec("s", 0.1, GB),), slo_s=1.0, whole_model=True,
                  start_mechanisms=frozenset({"live"})) and Simulation(
            SimConfig(model="m", stages=(StageSpec("s", 0.1, GB),), slo_s=1.0, whole_model=True,
                      start_mechanisms=frozenset({"live"})), Scripted([(0.0, 1)]),
            Arrivals(times=np.zeros(1), sizes=np.ones(1, dtype=np.int64)))


def test_paraserve_borrows_helpers_that_leave_after_consolidation() -> None:
    from dataclasses import replace as dc_replace

    cal = Calibration(hosts=8, gpus_per_host=1, service_cv=0.0, h2d_gbps=16.0, disk_gbps=1.25, cold_fixed_s=0.2)
    cfg = SimConfig(model="m", stages=(StageSpec("m-stage-0", 0.05, SIZE),), slo_s=1.0, calibration=cal,
                    hop_s=0.001, queue_cap=10**9, initial_replicas=1, prewarm_hosts=0, drain_s=60.0,
                    start_mechanisms=frozenset({"paraserve"}), paraserve_slo_s=2.5, cache_on_ready=True)
    n = 400
    arrivals = Arrivals(times=np.linspace(0.0, 20.0, n, endpoint=False), sizes=np.ones(n, dtype=np.int64))
    res = Simulation(cfg, Scripted([(0.0, 1), (1.0, 2)]), arrivals).run()
    parts = res.paraserve_plans[0][0]
    assert parts == 4  # 10 GB at 1.25 GB/s: P = 3 fetches 2.7 s, P = 4 2.0 s (+ copy, compute): meets 2.5 s
    kept = [r for r in res.launched if not r.helper]
    helpers = [r for r in res.launched if r.helper]
    assert len(kept) == 1 and len(helpers) == 3
    first, consolidated = dc_replace(cal).paraserve_s(SIZE, 4)
    for rep in res.launched:
        assert rep.ready_at - rep.requested_at == pytest.approx(first)
    # helpers served their part and left at consolidation; the kept replica's host caches the stage then
    assert all(h.state == "gone" for h in helpers) and any(h.first_done > 0 for h in helpers)
    assert kept[0].state == "ready" and kept[0].host.is_cached("m-stage-0")
    assert all(not h.host.is_cached("m-stage-0") for h in helpers)
    assert not np.isnan(res.latencies_ms).any()


def test_a_paraserve_group_is_never_surplus_before_it_consolidates() -> None:
    """The live rule (quart_kernel.convergence): a scale-down while a group loads stops another replica; the
    group's helpers serve their part and leave only once it has consolidated."""
    cal = Calibration(hosts=8, gpus_per_host=1, service_cv=0.0, h2d_gbps=16.0, disk_gbps=1.25, cold_fixed_s=0.2)
    cfg = SimConfig(model="m", stages=(StageSpec("m-stage-0", 0.05, SIZE),), slo_s=1.0, calibration=cal,
                    hop_s=0.001, queue_cap=10**9, initial_replicas=1, prewarm_hosts=0, drain_s=30.0,
                    start_mechanisms=frozenset({"paraserve"}), paraserve_slo_s=2.5, cache_on_ready=True)
    arrivals = Arrivals(times=np.linspace(0.0, 10.0, 100, endpoint=False), sizes=np.ones(100, dtype=np.int64))
    sim = Simulation(cfg, Scripted([(0.0, 1), (1.0, 2), (1.5, 1)]), arrivals)
    [initial] = sim.stages[0].ready
    res = sim.run()
    helpers = [r for r in res.launched if r.helper]
    [kept] = [r for r in res.launched if not r.helper]
    assert initial.state == "gone" and kept.state == "ready"  # the scale-down took the replica outside the group
    assert helpers and all(h.state == "gone" and h.ready_at > 0 for h in helpers)  # served, then left
    assert all(h.slot.replica is None for h in helpers)  # their GPUs are free again
    assert not np.isnan(res.latencies_ms).any()
