"""The simulator's generation data plane (quart_tools.sim.generation): sessions prefill once, then decode one
token per step through the stages, pinned per stage, with KV capacity per replica."""

from __future__ import annotations

import numpy as np
import pytest
from gateway_plugin.policies import make_policy
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision
from quart_tools.arrivals import Arrivals
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec

MB = 1_000_000


def _stages(decode_s: tuple[float, ...], prefill_s: float = 0.001, kv_tokens: int = 100_000) -> tuple:
    return tuple(StageSpec(f"g-stage-{i}", d, 10 * MB, decode_s=d, prefill_s_per_token=prefill_s, kv_tokens=kv_tokens)
                 for i, d in enumerate(decode_s))


def _run(stages, times, prompt, new, cv=0.0, seed=0, policy=None, cal=None, **cfg):
    cal = cal or Calibration(hosts=1, gpus_per_host=8, service_cv=cv)
    config = SimConfig(model="g", stages=stages, slo_s=1.0, calibration=cal, generation=True, hop_s=0.0,
                       placer="first-fit", keysmanager=False, queue_cap=10**6, drain_s=600.0, seed=seed, **cfg)
    n = len(times)
    arrivals = Arrivals(np.asarray(times, dtype=float), np.ones(n, dtype=np.int64),
                        tokens=np.full(n, prompt, dtype=np.int64), generated=np.full(n, new, dtype=np.int64))
    return Simulation(config, policy or make_policy("static", replicas=1), arrivals).run()


def test_one_session_ttft_is_the_prefill_through_the_stages_and_tpot_the_sum_of_decode_steps() -> None:
    stages = _stages((0.002, 0.004, 0.002), prefill_s=0.0001)
    res = _run(stages, [0.0], prompt=100, new=5)
    prefill = sum(max(d, 100 * 0.0001) for d in (0.002, 0.004, 0.002))  # 10 ms at every stage here
    assert res.ttft_ms[0] == pytest.approx(1000 * prefill)
    assert res.tpot_ms[0] == pytest.approx(1000 * (0.002 + 0.004 + 0.002))  # one session: no overlap
    assert res.latencies_ms[0] == pytest.approx(1000 * (prefill + 4 * 0.008))
    assert len(res.token_gaps) == 4


def test_a_waiting_session_s_ttft_is_its_queue_plus_the_prefill() -> None:
    stages = _stages((0.001, 0.001, 0.001), prefill_s=0.0001)  # prefill of 100 tokens: 10 ms per stage
    res = _run(stages, [0.0, 0.0], prompt=100, new=1)
    assert sorted(res.ttft_ms.tolist()) == pytest.approx([30.0, 40.0])  # B waits 10 ms at stage 0, then pipelines


def test_pipelined_decode_is_bound_by_the_slowest_stage() -> None:
    """k sessions share one replica per stage: each token takes max(Σ stage steps, k × the slowest step)."""
    stages = _stages((0.01, 0.02, 0.01), prefill_s=0.0)
    alone = _run(stages, [0.0], prompt=4, new=50)
    assert alone.tpot_ms[0] == pytest.approx(40.0)
    four = _run(stages, [0.0] * 4, prompt=4, new=50, decode_batch=1)
    assert np.median(four.tpot_ms) == pytest.approx(4 * 20.0, rel=0.02)  # the middle stage is always busy


def test_batched_decode_steps_cost_one_weight_read_plus_each_session_s_kv_read() -> None:
    """With continuous batching the waiting decode steps of a replica run as one: four sessions decode about as
    fast as one, each step longer by the sessions' KV read at the GPU's memory bandwidth."""
    kv = 1e6  # bytes per position per stage
    stages = tuple(StageSpec(f"g-stage-{i}", d, 10 * MB, decode_s=d, prefill_s_per_token=0.0, kv_tokens=10**6,
                             kv_bytes_per_token=kv) for i, d in enumerate((0.01, 0.02, 0.01)))
    four = _run(stages, [0.0] * 4, prompt=4, new=50)
    cal = Calibration()
    alone = _run(stages, [0.0], prompt=4, new=50)
    assert alone.tpot_ms[0] > 40.0  # its own KV read
    assert np.median(four.tpot_ms) < 1.5 * alone.tpot_ms[0]
    assert np.median(four.tpot_ms) > alone.tpot_ms[0]  # four sessions' KV per step
    per_pos_ms = 1000 * kv / (cal.hbm_gbytes_s * 1e9)
    assert alone.tpot_ms[0] == pytest.approx(40.0 + 3 * per_pos_ms * 29, rel=0.2)  # ~29 positions held on average


def test_kv_capacity_holds_a_session_at_the_entry_until_room_frees() -> None:
    stages = _stages((0.001, 0.001), prefill_s=0.0001, kv_tokens=150)  # room for one session of 100 + 10
    res = _run(stages, [0.0, 0.0], prompt=100, new=10)
    first_end = res.latencies_ms.min()
    assert res.ttft_ms.max() == pytest.approx(first_end + 20.0)  # admitted when the first one ended
    both = _run(_stages((0.001, 0.001), prefill_s=0.0001, kv_tokens=220), [0.0, 0.0], prompt=100, new=10)
    assert both.ttft_ms.max() == pytest.approx(30.0)  # room for both: only the stage-0 queue


def test_generation_runs_are_deterministic_per_seed() -> None:
    stages = _stages((0.002, 0.003, 0.002), prefill_s=0.00005)
    rng = np.random.default_rng(3)
    times = np.sort(rng.uniform(0, 20, 200))
    a = _run(stages, times, prompt=200, new=20, cv=0.5, seed=7, policy=make_policy("quart"))
    b = _run(stages, times, prompt=200, new=20, cv=0.5, seed=7, policy=make_policy("quart"))
    c = _run(stages, times, prompt=200, new=20, cv=0.5, seed=8, policy=make_policy("quart"))
    assert np.array_equal(a.ttft_ms, b.ttft_ms, equal_nan=True) and np.array_equal(a.tpot_ms, b.tpot_ms)
    assert a.gpu_seconds == b.gpu_seconds
    assert not np.array_equal(a.tpot_ms, c.tpot_ms)
    assert not np.isnan(a.ttft_ms).any() and not np.isnan(a.latencies_ms).any()


def test_the_sessions_floor_adds_replicas_when_decode_steps_miss_the_tpot_share() -> None:
    """The controller's sessions' floor (gateway_plugin.policies.decode_capacity) runs in the simulator as live:
    sessions keep arriving at one replica per stage of a static policy; with a TPOT target the measured decode
    batches say how many sessions a replica carries within its share, the stages grow to that, and the sessions
    that arrive once the new replicas are up decode faster. Without a target nothing changes."""
    stages = _stages((0.01, 0.01, 0.01), prefill_s=0.0)
    times = np.arange(60) * 0.25

    class HoldOne:  # one replica per stage, as static-1, but a policy the floor may raise
        name = "hold-one"

        def decide(self, snap: PipelineSnapshot) -> Decision:
            return Decision(snap.time, tuple(StageDecision(1, s.cpus, "one") for s in snap.stages))

    def run(policy=None, **cfg):
        return _run(stages, times, prompt=8, new=200, decode_batch=4, cal=Calibration(hosts=2, gpus_per_host=16),
                    policy=policy or HoldOne(), **cfg)

    plain, floor = run(), run(tpot_slo_s=0.045)
    assert floor.gpu_seconds > 1.5 * plain.gpu_seconds
    late = slice(40, None)  # arrived after 10 s: the new replicas are up
    assert np.median(floor.tpot_ms[late]) < 0.7 * np.median(plain.tpot_ms[late])
    assert run(tpot_slo_s=0.0).gpu_seconds == plain.gpu_seconds
    static = run(make_policy("static", replicas=1), tpot_slo_s=0.045)  # the frontier's yardstick holds its k
    assert static.gpu_seconds == run(make_policy("static", replicas=1)).gpu_seconds == plain.gpu_seconds
