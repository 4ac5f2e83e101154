"""Scripted-snapshot tests of QUART (Correct, Smooth, CPU compensation) and the queueing formulas."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import pytest
from gateway_plugin.config import CPUConfig, QuartConfig, SmoothConfig
from gateway_plugin.policies import POLICY_NAMES, make_policy
from gateway_plugin.policies.cpu_model import CPULatencyModel
from gateway_plugin.policies.quart import QuartPolicy
from gateway_plugin.policies.queueing import erlang_b, erlang_c, mmc_delay, servers_for_delay
from gateway_plugin.policies.smooth import beta, reclaim_target
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot


def stage(i: int, **kw) -> StageSnapshot:
    base = dict(name=f"m-stage-{i}", index=i, arrival_rate=1.0, service_rate=10.0, replicas=1, target_s=0.2)
    base.update(kw)
    return StageSnapshot(**base)


def snap(t: float, *stages: StageSnapshot, window_s: float = 10.0) -> PipelineSnapshot:
    return PipelineSnapshot(time=t, model="m", stages=tuple(stages), window_s=window_s)


def erlang_c_exact(c: int, a: Fraction) -> Fraction:
    """Textbook factorial form, exact rationals: reference for the stable recurrence."""
    term, total = Fraction(1), Fraction(0)
    for k in range(c):
        total += term
        term = term * a / (k + 1)
    top = term * c / (c - a)  # a^c / c! · c/(c−a)
    return top / (total + top)


def test_erlang_c_known_values() -> None:
    assert erlang_c(3, 2.0) == pytest.approx(4 / 9)
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = ρ
    for c, a in [(5, 3.5), (20, 17), (50, 45)]:
        assert erlang_c(c, a) == pytest.approx(float(erlang_c_exact(c, Fraction(a))), rel=1e-9)
    assert erlang_b(1, 1.0) == pytest.approx(0.5)


def test_erlang_c_stable_at_200_servers() -> None:
    value = erlang_c(200, 190.0)
    assert 0.0 < value < 1.0 and math.isfinite(value)
    assert value == pytest.approx(float(erlang_c_exact(200, Fraction(190))), rel=1e-9)
    assert erlang_c(200, 200.0) == 1.0
    assert math.isinf(mmc_delay(10.0, 1.0, 10))
    assert mmc_delay(0.5, 1.0, 1) == pytest.approx(2.0)  # M/M/1: 1/(μ−λ)
    assert servers_for_delay(8.0, 1.0, 1.5) == min(c for c in range(9, 40) if mmc_delay(8.0, 1.0, c) <= 1.5)


def test_overloaded_stage_gains_replicas_and_is_key() -> None:
    policy = make_policy("quart")
    # ρ < 1 but delay far above target: 1.8 req/s at 1 req/s/replica on 2 replicas
    s = snap(0.0, stage(0), stage(1, arrival_rate=1.8, service_rate=1.0, replicas=2, target_s=1.2), stage(2))
    d = policy.decide(s)
    assert d.stages[1].replicas > 2
    assert 1 in d.key_stages and 0 not in d.key_stages
    assert d.stages[0].replicas == 1


def test_rho_at_least_one_gets_enough_replicas_for_stability() -> None:
    policy = make_policy("quart")
    s = snap(0.0, stage(0, arrival_rate=10.0, service_rate=2.0, replicas=2, target_s=1.0))
    d = policy.decide(s)
    assert d.stages[0].replicas * 2.0 > 10.0  # ρ < 1 afterwards
    assert d.stages[0].replicas >= math.ceil(10.0 / (2.0 * 0.95))


def test_scale_down_never_goes_unstable_nor_misses_the_target() -> None:
    """The simulator's failure case: λ = 259/s, μ = 108/s on 4 replicas must not shrink to 2 (ρ = 1.2)."""
    policy = make_policy("quart")
    busy = stage(0, arrival_rate=259.0, service_rate=108.0, replicas=4, target_s=0.05)
    for t in range(0, 200, 5):  # long past any cooldown, delay well under target at 4 replicas
        decision = policy.decide(snap(float(t), busy))
        replicas = decision.stages[0].replicas
        assert replicas >= 3  # 3 replicas: ρ = 0.80
        assert mmc_delay(259.0, 108.0, replicas) <= 0.05
    # a burst in the last second raises the floor even when the window's average is low
    spiky = stage(0, arrival_rate=50.0, arrival_rate_recent=300.0, service_rate=108.0, replicas=4, target_s=0.05)
    assert make_policy("quart").decide(snap(100.0, spiky)).stages[0].replicas >= 3


def test_max_replicas_respected_and_no_windup() -> None:
    policy = make_policy("quart")
    for t in range(20):  # long saturation at r_max
        d = policy.decide(snap(float(t), stage(0, arrival_rate=100.0, service_rate=1.0, replicas=4, max_replicas=4)))
        assert d.stages[0].replicas == 4
    assert abs(policy.corrector._state[0].integral) <= QuartConfig().correct.integral_limit


def test_idle_stage_loses_replicas_only_after_cooldown() -> None:
    policy = make_policy("quart", mode="pid", correct={"scale_down_cooldown_s": 30.0})
    busy = stage(0, arrival_rate=20.0, service_rate=2.0, replicas=4, target_s=1.0)
    up = policy.decide(snap(0.0, busy))
    assert up.stages[0].replicas > 4
    r = up.stages[0].replicas
    idle = stage(0, arrival_rate=0.05, service_rate=2.0, replicas=r, target_s=1.0)
    for t in (1.0, 10.0, 29.0):
        assert policy.decide(snap(t, idle)).stages[0].replicas == r
    later = policy.decide(snap(31.0, idle)).stages[0].replicas
    assert later < r
    # keeps shrinking towards r_min, never below it
    current = later
    for t in range(32, 200):
        current = policy.decide(snap(float(t), stage(0, arrival_rate=0.05, service_rate=2.0, replicas=current,
                                                        target_s=1.0, min_replicas=2))).stages[0].replicas
    assert current == 2


def test_smoothing_never_below_r_min_nor_busy() -> None:
    cfg = SmoothConfig()
    assert beta(0.0, cfg) == 0.0 and beta(100.0, cfg) > 0.99
    assert all(beta(a, cfg) <= beta(b, cfg) for a, b in [(0.1, 0.5), (0.5, 1.0), (1.0, 4.0), (4.0, 8.0)])
    assert reclaim_target([1, 10, 1], 1, beta_i=0.0, r_min=3, busy_replicas=0) == 3
    assert reclaim_target([1, 10, 1], 1, beta_i=0.0, r_min=1, busy_replicas=6) == 6
    assert reclaim_target([1, 10, 1], 1, beta_i=1.0, r_min=1, busy_replicas=0) == 10


def test_quart_smooth_reclaims_calm_overprovisioned_stage_but_keeps_r_min() -> None:
    policy = make_policy("quart", correct={"scale_down_cooldown_s": 0.0, "max_step_down": 100})
    calm = dict(arrival_rate=4.0, service_rate=10.0, cv_arrival=0.1, target_s=1.0)
    s = snap(100.0, stage(0, replicas=1, **calm), stage(1, replicas=9, min_replicas=3, **calm), stage(2, replicas=1, **calm))
    d = policy.decide(s)
    assert 3 <= d.stages[1].replicas < 9
    assert "smooth" in d.stages[1].reason


def _cpu_records() -> list[dict]:
    # service time = 0.05 + 0.4 / cpus seconds (parallel part scales with CPUs)
    return [
        {"cpus": c, "queue_len": q, "param_bytes": 1e9, "activation_bytes": 1e6, "service_ms": 1000 * (0.05 + 0.4 / c)}
        for c in (1, 2, 3, 4, 6, 8)
        for q in (0, 2, 5)
    ]


def test_cpu_model_fits_and_respects_cpu_max() -> None:
    model = CPULatencyModel.fit(_cpu_records())
    assert model.service_s(4, 0, 1e9, 1e6) == pytest.approx(0.15, rel=0.05)
    kwargs = dict(arrival_rate=3.0, servers=2, queue_len=0, param_bytes=1e9, activation_bytes=1e6, cpus_from=1.0, cpu_step=0.5)
    c = model.smallest_cpus(target_s=0.5, cpu_max=8.0, **kwargs)
    assert c is not None and 1.0 < c <= 8.0
    assert mmc_delay(3.0, 1 / model.service_s(c, 0, 1e9, 1e6), 2) <= 0.5
    assert model.smallest_cpus(target_s=0.5, cpu_max=c - 0.5, **kwargs) is None  # CPU_max below the need
    with pytest.raises(ValueError, match="at least 3"):
        CPULatencyModel.fit(_cpu_records()[:2])


def test_quart_cpu_compensation_and_fallback_to_correct() -> None:
    model = CPULatencyModel.fit(_cpu_records())
    # stage 1 is over-provisioned relative to calm neighbours; fewer replicas only meet the target with more CPUs
    def run(cpu_max: float):
        policy = QuartPolicy(
            QuartConfig(cpu=CPUConfig(cpu_max=cpu_max)), cpu_model=model
        )
        policy.corrector.config = policy.corrector.config.__class__(scale_down_cooldown_s=0.0, max_step_down=100)
        calm = dict(arrival_rate=4.0, cv_arrival=0.1, param_bytes=int(1e9), activation_bytes=1e6, cpus=1.0)
        st = stage(1, replicas=4, service_rate=1 / 0.45, target_s=0.9, **calm)
        nb = dict(replicas=1, service_rate=10.0, target_s=1.0, **calm)
        return policy.decide(snap(50.0, stage(0, **nb), st, stage(2, **nb))).stages[1]

    generous = run(8.0)
    assert generous.replicas < 4 and 1.0 < generous.cpus <= 8.0
    assert generous.replicas == 2
    strict = run(1.0)  # no CPU headroom: only the reclaim that needs no extra CPU is made
    assert strict.replicas == 3 and strict.cpus == 1.0
    assert mmc_delay(4.0, 1 / 0.45, 3) <= 0.9 < mmc_delay(4.0, 1 / 0.45, 2)


def test_every_policy_answers_one_decision_per_stage_within_bounds() -> None:
    stages = [stage(i, arrival_rate=3.0 * (i + 1), service_rate=2.0, replicas=2, max_replicas=10) for i in range(4)]
    for name in POLICY_NAMES:
        policy = make_policy(name)
        for t in range(0, 90, 3):
            d = policy.decide(snap(float(t), *stages))
            assert len(d.stages) == 4 and d.time == float(t)
            assert all(1 <= sd.replicas <= 10 for sd in d.stages), (name, d)


def test_unknown_policy_and_setting_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="no setting"):
        make_policy("static", replica=3)


def test_cpu_profile_from_router_records_and_flat_rows() -> None:
    import json

    from gateway_plugin.metrics import RequestRecord, StageVisit
    from gateway_plugin.policies.cpu_model import profiling_rows

    lines = []
    for r in _cpu_records():
        visit = StageVisit(0, "m-stage-0", 1.0, r["service_ms"], cpus=r["cpus"], queue_len=r["queue_len"],
                           activation_bytes=int(r["activation_bytes"]), param_bytes=int(r["param_bytes"]))
        lines.append(RequestRecord("x", "m", 0.0, 1.0, 200, 1.0, [visit]).to_json())
    lines.append(RequestRecord("y", "m", 0.0, 1.0, 504, 1.0, []).to_json())
    lines.append(json.dumps(_cpu_records()[0]))
    rows = profiling_rows(lines)
    assert len(rows) == len(_cpu_records()) + 1
    assert CPULatencyModel.fit(rows).service_s(2, 0, 1e9, 1e6) == pytest.approx(0.25, rel=0.05)


def test_cv_model_trains_from_controller_log(tmp_path) -> None:
    import json
    from dataclasses import asdict

    from gateway_plugin.policies.cv_model import load_cv_model, main

    log = tmp_path / "control.jsonl"
    with open(log, "w") as fh:
        for t in range(30):
            s = snap(float(t), *(stage(i, cv_arrival=1.0 + (t + i) % 3) for i in range(3)))
            fh.write(json.dumps({"snapshot": asdict(s), "decision": {}}) + "\n")
    out = tmp_path / "cv.safetensors"
    assert main(["--log", str(log), "--out", str(out), "--epochs", "20"]) == 0
    assert len(load_cv_model(str(out)).predict(s)) == 3


def test_dead_time_gate_ignores_a_burst_that_drains_before_a_replica_starts() -> None:
    # 10 queued at 20 req/s: drains in 0.5 s < the 1 s a new replica needs; steady load is light
    short = stage(0, arrival_rate=2.0, service_rate=20.0, replicas=1, queue_len=10, mean_wait_s=0.3, target_s=0.1)
    assert make_policy("quart", mode="pid").decide(snap(0.0, short)).stages[0].replicas == 1
    ungated = make_policy("quart", mode="pid", correct={"dead_time_gate": False})
    assert ungated.decide(snap(0.0, short)).stages[0].replicas > 1
    long = stage(0, arrival_rate=2.0, service_rate=20.0, replicas=1, queue_len=60, mean_wait_s=1.5, target_s=0.1)
    assert make_policy("quart", mode="pid").decide(snap(0.0, long)).stages[0].replicas > 1
    # the platform measured 50 ms from ask to ready (a fork): the same 0.5 s backlog is now worth replicas,
    # whatever the configured default says
    forked = replace(short, replica_start_s=0.05)
    assert make_policy("quart", mode="pid").decide(snap(0.0, forked)).stages[0].replicas > 1
    slow = replace(short, replica_start_s=2.0)  # a measured 2 s start: still gated
    assert make_policy("quart", mode="pid", correct={"replica_start_s": 0.01}).decide(snap(0.0, slow)).stages[0].replicas == 1


def test_replica_start_time_is_learned_from_snapshots() -> None:
    policy = make_policy("quart", correct={"replica_start_s": 1.0, "start_time_alpha": 1.0})
    base = dict(arrival_rate=1.0, service_rate=10.0, target_s=1.0)
    policy.decide(snap(0.0, stage(0, replicas=1, pending_replicas=2, **base)))
    policy.decide(snap(1.0, stage(0, replicas=1, pending_replicas=2, **base)))
    policy.decide(snap(3.0, stage(0, replicas=3, pending_replicas=0, **base)))
    assert policy.corrector.replica_start_s(0) == pytest.approx(3.0)
    assert policy.corrector.replica_start_s(1) == 1.0  # never observed: the configured default


def test_backlog_lookahead_sizes_downstream_stages_for_the_released_burst() -> None:
    # a 40-request burst queued at stage 0 (one 50/s replica, a fork takes 50 ms); stages 1–2 idle at 1 replica
    kw = dict(arrival_rate=20.0, service_rate=50.0, replicas=1, target_s=0.05, max_replicas=6, replica_start_s=0.05)
    burst = snap(0.0, stage(0, queue_len=40, busy=1, mean_wait_s=0.4, **kw), stage(1, **kw), stage(2, **kw))
    decision = make_policy("quart", mode="pid", backlog_lookahead=True).decide(burst)
    first = decision.stages[0].replicas
    assert first > 1
    # stage 0 will release the backlog at first × 50/s: the next stages keep up with it (ρ ≤ 0.95), in this step
    for d in decision.stages[1:]:
        assert d.replicas >= min(6, -(-first * 50 // (0.95 * 50))) and "backlog" in d.reason
    assert set(decision.key_stages) == {0, 1, 2}
    plain = make_policy("quart", mode="pid").decide(burst)  # off by default
    assert [d.replicas for d in plain.stages[1:]] == [1, 1]
    # a backlog gone before a replica could start (2 s measured start) raises nothing downstream
    slow = snap(0.0, *(replace(s, replica_start_s=2.0) for s in burst.stages))
    assert [d.replicas for d in make_policy("quart", mode="pid", backlog_lookahead=True).decide(slow).stages[1:]] == [1, 1]


def test_peak_rate_option_sizes_for_the_last_second() -> None:
    # 5 req/s over the window but 40 req/s in the last second, 20/s replicas: M/M/c at the peak needs more
    s = stage(0, arrival_rate=5.0, arrival_rate_recent=40.0, service_rate=20.0, replicas=2, target_s=0.2)
    window = make_policy("quart", mode="pid").decide(snap(0.0, s)).stages[0].replicas
    peak = make_policy("quart", mode="pid", correct={"peak_rate": True}).decide(snap(0.0, s)).stages[0].replicas
    assert peak > window >= 2


def test_idle_stages_give_back_replicas_in_cooldown_when_another_stage_is_starved() -> None:
    kw = dict(arrival_rate=10.0, service_rate=50.0, target_s=0.05, max_replicas=12, replica_start_s=0.1)

    def run(stage1_pending: int) -> int:
        policy = make_policy("quart", mode="pid", smooth={"enabled": False})
        policy.decide(snap(0.0, stage(0, replicas=1, queue_len=200, mean_wait_s=2.0, **kw), stage(1, replicas=1, **kw)))
        desired = 0
        for t in (1.0, 2.0, 3.0, 3.5):  # stage 0 got its 12 and is idle now; stage 1 waits for its asks
            s0 = stage(0, replicas=12, **kw)
            s1 = stage(1, replicas=1, pending_replicas=stage1_pending, queue_len=60, mean_wait_s=1.0, **kw)
            desired = policy.decide(snap(t, s0, s1)).stages[0].replicas
        return desired

    assert run(stage1_pending=0) == 12  # nobody waits: stage 0 keeps its replicas through the cooldown
    assert run(stage1_pending=4) < 12  # stage 1's asks cannot be placed: idle stage 0 releases early
