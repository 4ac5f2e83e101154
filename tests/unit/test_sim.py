"""Simulator sanity: queueing theory, determinism, scale-up delay by source, live-metrics parity."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gateway_plugin.policies import make_policy
from gateway_plugin.policies.queueing import mmc_delay
from gateway_plugin.snapshot import Decision, StageDecision
from quart_tools.arrivals import Arrivals, poisson_arrivals
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec
from quart_tools.sim.scenario import run, system
from support.scripted import Scripted

GB = 1_000_000_000


def _one_stage(service_s: float, cal: Calibration, **kw) -> SimConfig:
    return SimConfig(model="m", stages=(StageSpec("m-stage-0", service_s, 2 * GB),), slo_s=1.0,
                     calibration=cal, hop_s=0.0, queue_cap=10**9, **kw)


@pytest.mark.parametrize("servers,rho", [(1, 0.7), (4, 0.85)])
def test_mmc_matches_erlang_c(servers: int, rho: float) -> None:
    mu = 10.0  # 100 ms mean service, exponential (gamma CV 1)
    lam = rho * servers * mu
    cal = Calibration(service_cv=1.0, hosts=1, gpus_per_host=servers)
    cfg = _one_stage(1.0 / mu, cal, initial_replicas=servers, placer="first-fit", keysmanager=False)
    arrivals = poisson_arrivals(lam, 120_000 / lam, seed=7)
    res = Simulation(cfg, make_policy("static", replicas=servers), arrivals).run()
    lat_s = res.latencies_ms / 1000.0
    assert not np.isnan(lat_s).any() and res.rejected == 0
    expected = mmc_delay(lam, mu, servers)
    assert lat_s.mean() == pytest.approx(expected, rel=0.06), (lat_s.mean(), expected)


def test_same_seed_same_run() -> None:
    arrivals = poisson_arrivals(100.0, 60.0, seed=1)
    a, ra = run("bert-21b", "quart", arrivals, seed=3)
    b, rb = run("bert-21b", "quart", arrivals, seed=3)
    c, _ = run("bert-21b", "quart", arrivals, seed=4)
    assert np.array_equal(ra.latencies_ms, rb.latencies_ms, equal_nan=True)
    assert a["gpu_seconds"] == b["gpu_seconds"] and ra.samples == rb.samples
    assert a["mean_ms"] != c["mean_ms"]  # other service-time draws


def _ready_times(keysmanager: bool, plan, gpu_keep_s: float = 0.0, prewarm: int = -1):
    cal = Calibration(hosts=1, gpus_per_host=4, service_cv=0.0)
    cfg = _one_stage(0.01, cal, keysmanager=keysmanager, placer="cache-aware", gpu_keep_s=gpu_keep_s,
                     prewarm_hosts=prewarm, drain_s=200.0)
    arrivals = Arrivals(times=np.arange(0.0, 150.0, 0.5), sizes=np.ones(300, dtype=np.int64))
    res = Simulation(cfg, Scripted(plan), arrivals).run()
    return cal, res


def test_scale_up_takes_the_delay_of_its_source() -> None:
    cal, res = _ready_times(keysmanager=True, plan=[(0.0, 2)])
    assert res.starts_by_source == {"gpu": 0, "fork": 1, "cold": 0}
    assert res.ready_s_by_source["fork"] == [pytest.approx(cal.fork_s(2 * GB))]
    assert cal.fork_s(2 * GB) == pytest.approx(0.10 + 2 / (5.375 / 0.8), rel=1e-6)  # paper: 800 ms / 5.4 GB

    cal, res = _ready_times(keysmanager=False, plan=[(0.0, 2)])
    assert res.starts_by_source == {"gpu": 0, "fork": 0, "cold": 1}
    assert res.ready_s_by_source["cold"] == [pytest.approx(cal.cold_s(2 * GB))]
    assert cal.cold_s(5_375_000_000) == pytest.approx(45.0 + 0.8, rel=1e-6)  # paper: ≈45 s from disk

    # 2 → 1 → 2 with parameters kept resident on the GPU: the second start is a "gpu" start.
    cal, res = _ready_times(keysmanager=False, plan=[(0.0, 2), (60.0, 1), (70.0, 2)], gpu_keep_s=30.0)
    assert res.starts_by_source == {"gpu": 1, "fork": 0, "cold": 1}
    assert res.ready_s_by_source["gpu"] == [pytest.approx(cal.gpu_ready_s)]


def test_keysmanager_caches_after_cold_start_and_evicts_lru() -> None:
    # Memory for 2 stages of 2 GB under the 85 % threshold: a third cold start evicts the LRU one.
    from quart_tools.sim.cluster import Host

    host = Host("h", gpus=4, memory_limit=int(5.0 * GB), keysmanager=True, eviction_threshold=0.85)
    assert host.cache_stage("a", 2 * GB, 1.0) and host.cache_stage("b", 2 * GB, 2.0)
    host.touch("a", 3.0)
    assert host.cache_stage("c", 2 * GB, 4.0)
    assert set(host.cache) == {"a", "c"} and host.evictions == 1
    assert not host.cache_stage("big", 6 * GB, 5.0)  # can never fit: not cached, nothing evicted
    assert set(host.cache) == {"a", "c"}
    assert Host("n", 4, 10 * GB, keysmanager=False).cache_stage("a", GB, 0.0) is False


def test_whole_model_mode_serves_without_pipelining() -> None:
    # One request at a time through 8 stages of 10 ms each: 80 ms, and a second request that arrives
    # 10 ms later must wait for the whole instance (a pipeline would let it into stage 0 at 10 ms).
    cal = Calibration(hosts=2, gpus_per_host=4, service_cv=0.0)
    stages = tuple(StageSpec(f"m-stage-{i}", 0.01, GB) for i in range(8))
    cfg = SimConfig("m", stages, 1.0, cal, keysmanager=False, placer="first-fit", whole_model=True, hop_s=0.0)
    arrivals = Arrivals(times=np.array([0.0, 0.01]), sizes=np.ones(2, dtype=np.int64))
    res = Simulation(cfg, make_policy("static", replicas=1), arrivals).run()
    assert res.latencies_ms.tolist() == pytest.approx([80.0, 150.0])
    piped = Simulation(replace(cfg, whole_model=False), make_policy("static", replicas=1), arrivals).run()
    assert piped.latencies_ms.tolist() == pytest.approx([80.0, 80.0])


def test_systems() -> None:
    assert system("quart").keysmanager and system("quart").placer == "cache-aware"
    assert not system("inferline").keysmanager and system("inferline").placer == "first-fit"
    assert system("infless").whole_model and system("infless+km").keysmanager
    assert not system("quart-no-km").keysmanager
    for retired in ("nope", "quart+rho-floor"):  # the diagnostic's floor is in the corrector now
        with pytest.raises(ValueError, match="unknown system"):
            system(retired)


def test_hop_holds_the_replica_and_start_time_is_measured() -> None:
    """As in the live router, a hop is part of the replica's busy time (the router times its whole call):
    two requests at once on one replica of a 10 ms stage with a 5 ms hop end at 15 and 30 ms. The
    stage's measured ask → ready time (the gateway's FunctionState.start_s) reaches the snapshot."""
    cal = Calibration(hosts=1, gpus_per_host=4, service_cv=0.0)
    cfg = replace(_one_stage(0.01, cal, placer="first-fit", keysmanager=False), hop_s=0.005)
    arrivals = Arrivals(times=np.array([0.0, 0.0]), sizes=np.ones(2, dtype=np.int64))
    res = Simulation(cfg, make_policy("static", replicas=1), arrivals).run()
    assert res.latencies_ms.tolist() == pytest.approx([15.0, 30.0])
    outside = Simulation(replace(cfg, hop_holds_replica=False), make_policy("static", replicas=1), arrivals).run()
    assert outside.latencies_ms.tolist() == pytest.approx([15.0, 25.0])

    cal = Calibration(hosts=1, gpus_per_host=4, service_cv=0.0)
    sim = Simulation(_one_stage(0.01, cal, keysmanager=True, placer="cache-aware", drain_s=20.0),
                     Scripted([(0.0, 2)]), Arrivals(times=np.arange(0.0, 10.0, 0.5), sizes=np.ones(20, dtype=np.int64)))
    assert sim.control.stage_state("m-stage-0").start_s == -1.0  # nothing started yet: unknown, as live
    sim.run()
    assert sim.control.stage_state("m-stage-0").start_s == pytest.approx(cal.fork_s(2 * GB))


def test_cli_run_and_small_fig7(tmp_path) -> None:
    import json

    from quart_tools.sim.cli import main

    out = tmp_path / "one.json"
    assert main(["--model", "wideresnet", "--system", "quart", "--duration", "20", "--load", "0.2",
                 "--out", str(out), "--series-out", str(tmp_path / "s.jsonl")]) == 0
    entry = json.loads(out.read_text())
    assert entry["policy"] == "quart" and entry["requests"] > 0 and entry["completed"] > 0
    assert set(entry["slo_attainment"]) == {"1.0", "1.5", "2.0", "2.5", "3.0"}
    assert (tmp_path / "s.jsonl").read_text().count("\n") > 8 * 19
    out = tmp_path / "fig7.json"
    assert main(["--experiment", "fig7", "--models", "wideresnet", "--cvs", "1", "--systems", "quart,cocktail",
                 "--duration", "20", "--load", "0.2", "--workers", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(e["model"], e["target_cv"], e["policy"]) for e in doc["entries"]] == [
        ("wideresnet", 1.0, "quart"), ("wideresnet", 1.0, "cocktail")]
    row = doc["summary"]["vs_best_baseline"][0]
    assert row["best_baseline"] == "cocktail" and row["best_slo_baseline"] == "cocktail"
    assert row["slo_2x_reachable"] == (row["top_slo15"] <= 0.5)
    assert row["mean_ratio"] == pytest.approx(doc["entries"][0]["mean_ms"] / doc["entries"][1]["mean_ms"])
    with pytest.raises(SystemExit):
        main(["--model", "nope"])


class PerStage:
    """Test double: per-stage replicas by time; keeps the snapshots it saw."""

    name = "per-stage"

    def __init__(self, plans: list[list[tuple[float, int]]]):
        self.plans, self.seen = plans, []

    def decide(self, snap):
        self.seen.append(snap)
        return Decision(snap.time, tuple(StageDecision([r for t, r in plan if snap.time >= t][-1])
                                         for plan in self.plans))


def test_unplaced_replicas_stay_desired_and_are_placed_when_a_gpu_frees() -> None:
    """As the embedded gateway: an ask the full cluster cannot place stays desired (the policy sees it
    pending) and is placed by the reconcile pass as soon as a GPU is released."""
    cal = Calibration(hosts=1, gpus_per_host=4, service_cv=0.0)
    stages = (StageSpec("m-stage-0", 0.01, GB), StageSpec("m-stage-1", 0.01, GB))
    cfg = SimConfig("m", stages, 1.0, cal, keysmanager=True, placer="first-fit", hop_s=0.0, drain_s=30.0)
    # Stage 0 wants 3 and stage 1 wants 2 on 4 GPUs (stage 1's ask is unplaced); stage 0 drops to 1 at t = 10.
    policy = PerStage([[(0.0, 3), (10.0, 1)], [(0.0, 2)]])
    arrivals = Arrivals(times=np.arange(0.0, 20.0, 0.5), sizes=np.ones(40, dtype=np.int64))
    res = Simulation(cfg, policy, arrivals).run()
    first = next(s for s in policy.seen if s.time == 2.0)
    held = [s.replicas for s in first.stages]
    assert sum(held) == 4 and [s.replicas + s.pending_replicas for s in first.stages] == [3, 2]
    assert res.starts_by_source["fork"] == 3  # 2 at t = 0, the unplaced one once stage 0 shrank
    assert [s.replicas for s in policy.seen[-1].stages] == [1, 2]


def test_calibration_from_live_keysmanager_bench(tmp_path) -> None:
    import json

    bench = tmp_path / "km.json"
    bench.write_text(json.dumps({"rows": [
        {"stage_mb": 100, "fork_ready_ms": 30.0, "cold_ready_ms": 1200.0},
        {"stage_mb": 1000, "fork_ready_ms": 40.0, "cold_ready_ms": 3000.0},
        {"stage_mb": 4000, "fork_ready_ms": 70.0, "cold_ready_ms": 9000.0},
    ]}))
    cal = Calibration().with_keysmanager_bench(bench)
    assert cal.fork_fixed_s == pytest.approx(0.029, abs=0.002)  # intercept of the straight-line fit
    assert cal.cold_fixed_s == pytest.approx(1.0, abs=0.05)
    assert "live" in cal.sources["fork_fixed_s"] and cal.h2d_gbps == Calibration().h2d_gbps
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal.to_json()))
    assert Calibration.load(path) == cal
    path.write_text(json.dumps({"nope": 1}))
    with pytest.raises(ValueError, match="unknown calibration keys"):
        Calibration.load(path)


def test_simulated_cache_keeps_pinned_zygotes_as_the_live_keysmanager_does() -> None:
    from quart_tools.sim.cluster import make_hosts

    def fill(pinned: frozenset[str]) -> set[str]:
        [host] = make_hosts(1, gpus=4, memory_bytes=300, keysmanager=True, eviction_threshold=1.0)
        host.cache_stage("a", 100, now=1.0)
        host.cache_stage("b", 100, now=2.0)
        host.pinned = pinned
        host.cache_stage("c", 150, now=3.0)  # a cold start wants to cache c: something must go
        return set(host.cache)

    assert fill(frozenset()) == {"b", "c"}  # plain LRU drops a
    assert fill(frozenset({"a"})) == {"a", "c"}  # a is a key stage's pinned zygote: b goes instead
    assert fill(frozenset({"a", "b"})) == {"a", "b"}  # never a pinned one for a cache-after-cold
