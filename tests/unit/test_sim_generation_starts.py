"""Generation sessions while the simulated cluster scales (issue 29): a live (BlitzScale) replica runs its
sessions' steps over the layers it holds with the rest on a whole replica; a ParaServe group's helpers hand
their sessions to the kept worker with their KV caches (no re-prefill); a stopped replica drains its sessions."""

from __future__ import annotations

import numpy as np
from quart_tools.arrivals import Arrivals
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec
from support.scripted import Scripted

GB = 1_000_000_000
SIZE = 10 * GB
PROMPT, NEW = 256, 40


def _run(mechanisms: set[str], plan: list[tuple[float, int]], rate: float = 20.0, kv_tokens: int = 10**6):
    cal = Calibration(hosts=8, gpus_per_host=1, service_cv=0.0, nic_gbytes_s=12.5, h2d_gbps=16.0, disk_gbps=1.25,
                      fork_fixed_s=0.05, cold_fixed_s=0.2)
    stage = StageSpec("g-stage-0", 0.01, SIZE, 8192.0, decode_s=0.01, prefill_s_per_token=0.0002,
                      kv_tokens=kv_tokens, kv_bytes_per_token=1e5)
    cfg = SimConfig(model="g", stages=(stage,), slo_s=1.0, calibration=cal, hop_s=0.001, queue_cap=10**9,
                    initial_replicas=1, prewarm_hosts=0, drain_s=120.0, start_mechanisms=frozenset(mechanisms),
                    paraserve_slo_s=2.5, cache_on_ready=True, generation=True, decode_batch=4)
    n = int(rate * 20)
    arrivals = Arrivals(np.linspace(0.0, 20.0, n, endpoint=False), np.ones(n, dtype=np.int64),
                        tokens=np.full(n, PROMPT, dtype=np.int64), generated=np.full(n, NEW, dtype=np.int64))
    return Simulation(cfg, Scripted(plan), arrivals).run()


def _every_session_whole(res) -> None:
    """Every session ended with all its tokens, each produced once (a re-prefill would not add tokens, but a lost
    or repeated step would change the count of gaps)."""
    assert not np.isnan(res.latencies_ms).any() and not np.isnan(res.ttft_ms).any()
    assert len(res.token_gaps) == len(res.latencies_ms) * (NEW - 1)


def test_a_live_replica_serves_sessions_before_it_is_whole_and_lowers_ttft() -> None:
    live = _run({"peer", "live"}, [(0.0, 1), (1.0, 3)])
    peer = _run({"peer"}, [(0.0, 1), (1.0, 3)])
    _every_session_whole(live)
    _every_session_whole(peer)
    assert live.starts_by_source.get("live") == 2 and peer.starts_by_source.get("peer") == 2
    reps = [r for r in live.launched if r.source == "live"]
    assert all(r.first_done < r.ready_at for r in reps), "a live replica ran steps before its last layer was in"
    window = (live.arrival_s >= 1.0) & (live.arrival_s < 3.0)  # sessions arriving while the new replicas load
    assert np.mean(live.ttft_ms[window]) < np.mean(peer.ttft_ms[window])


def test_paraserve_helpers_hand_their_sessions_over_with_the_kv_cache() -> None:
    res = _run({"paraserve"}, [(0.0, 1), (1.0, 2)], rate=30.0)
    _every_session_whole(res)
    helpers = [r for r in res.launched if r.helper]
    assert helpers and all(h.state == "gone" for h in helpers)
    assert res.kv_migrations > 0  # sessions that were on helpers went on at the kept worker
    kept = [r for r in res.launched if not r.helper]
    assert all(r.consolidated_at > 0 for r in kept)


def test_a_stopped_replica_drains_its_sessions_before_it_is_released() -> None:
    res = _run({"peer"}, [(0.0, 1), (1.0, 3), (8.0, 1)])
    _every_session_whole(res)
    gone = [r for r in res.launched if r.state == "gone"]
    assert gone, "the scale-down stopped replicas"
    # a replica stopped with sessions pinned keeps its slot until the last of them ends
    assert res.gpu_seconds > 0
    assert all(r.slot.replica is not r for r in gone)


def test_kv_capacity_bounds_the_sessions_a_replica_holds() -> None:
    small = _run(set(), [(0.0, 1)], rate=20.0, kv_tokens=4 * (PROMPT + NEW))  # four sessions at a time
    big = _run(set(), [(0.0, 1)], rate=20.0)
    _every_session_whole(small)
    assert np.mean(small.ttft_ms) > np.mean(big.ttft_ms)  # sessions waited at the entry for room
