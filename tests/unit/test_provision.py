"""Scripted-snapshot tests of QUART's provisioning corrector (mode="provision", the default)."""

from __future__ import annotations

import pytest
from gateway_plugin.policies import make_policy
from gateway_plugin.policies.provision import expected_peak_rate, servers_for_target
from gateway_plugin.policies.queueing import mmc_delay
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot

KW = dict(service_rate=10.0, target_s=0.2, max_replicas=12, replica_start_s=0.5)


def stage(i: int, rate: float, replicas: int, **kw) -> StageSnapshot:
    base = dict(KW, name=f"m-stage-{i}", index=i, arrival_rate=rate, arrival_rate_recent=rate, replicas=replicas)
    base.update(kw)
    return StageSnapshot(**base)


def snap(t: float, *stages: StageSnapshot) -> PipelineSnapshot:
    return PipelineSnapshot(time=t, model="m", stages=tuple(stages))


def quiet(**config):
    """QUART without Smooth and (unless ``provision`` says otherwise) without the start-up estimate and the long-run
    floor: the tests of the other rules size for the rates they script (tests/unit/test_load_floor.py: the floor)."""
    config["provision"] = {"startup_estimate": False, "floor_horizon_s": 0.0, **config.get("provision", {})}
    return make_policy("quart", smooth={"enabled": False}, **config)


def test_servers_for_target_is_the_fewest_that_meet_delay_and_utilisation() -> None:
    c = servers_for_target(25.0, 10.0, 0.15, 0.95, 50)
    assert mmc_delay(25.0, 10.0, c) <= 0.15 < mmc_delay(25.0, 10.0, c - 1)
    assert servers_for_target(9.0, 10.0, 10.0, 0.8, 50) == 2  # ρ ≤ 0.8 needs 2 even with a lax target
    assert servers_for_target(1000.0, 10.0, 0.15, 0.95, 12) == 12  # capped
    assert servers_for_target(0.0, 10.0, 0.15, 0.95, 12) == 0


def test_the_expected_peak_grows_with_the_cv_and_with_a_shorter_span() -> None:
    assert expected_peak_rate(100.0, 0.0, 5.0, 5.0, 30.0) == 100.0  # a regular stream: its mean is its peak
    poisson = expected_peak_rate(100.0, 1.0, 5.0, 5.0, 30.0)
    assert poisson == pytest.approx(100.0 + 1.27 * (100.0 / 5.0) ** 0.5, rel=0.01)  # z of 6 windows ≈ 1.27
    assert expected_peak_rate(100.0, 4.0, 5.0, 5.0, 30.0) > poisson
    assert expected_peak_rate(100.0, 1.0, 1.0, 5.0, 30.0) > poisson  # one second seen: the mean is that uncertain
    assert expected_peak_rate(100.0, 1.0, 60.0, 5.0, 30.0) == poisson  # never narrower than one rate window
    assert expected_peak_rate(0.0, 4.0, 1.0, 5.0, 30.0) == 0.0


def test_a_new_stage_is_sized_for_the_expected_peak_until_the_peak_window_is_seen() -> None:
    # the first second shows 40 req/s with inter-arrival CV 4: sized for the expected peak of a full window, more
    # than 40 req/s needs; once peak_window_s has been seen, the observed peaks alone decide (and the hold applies)
    cfg = {"rate_window_s": 1.0, "peak_window_s": 4.0, "hold_min_s": 0.0, "hold_starts": 0.0}
    new = make_policy("quart", smooth={"enabled": False}, provision=cfg)
    first = new.decide(snap(0.0, stage(0, 40.0, 1, cv_arrival=4.0))).stages[0]
    need = servers_for_target(40.0, 10.0, 0.2, 0.95, 12)
    assert first.replicas > need
    assert first.replicas >= servers_for_target(expected_peak_rate(40.0, 4.0, 1.0, 1.0, 4.0), 10.0, 0.2, 0.95, 12)
    off = quiet(provision=cfg).decide(snap(0.0, stage(0, 40.0, 1, cv_arrival=4.0))).stages[0]
    assert off.replicas == need
    r = first.replicas
    for t in range(1, 12):
        r = new.decide(snap(float(t), stage(0, 40.0, r, cv_arrival=4.0))).stages[0].replicas
    assert r == need


def test_provision_is_the_default_mode_and_an_unknown_mode_is_an_error() -> None:
    assert make_policy("quart").provisioner is not None
    assert make_policy("quart", mode="pid").provisioner is None
    with pytest.raises(ValueError, match="mode"):
        make_policy("quart", mode="psychic")


def test_a_peak_is_provisioned_at_once_and_held_for_the_peak_window_and_the_hold() -> None:
    # the step rule (ski_rental_tail off): all of the reserve held for the hold, then released
    policy = quiet(provision={"rate_window_s": 0.5, "peak_window_s": 9.5, "hold_min_s": 5.0, "hold_starts": 0.0,
                              "ski_rental_tail": False})
    low = policy.decide(snap(0.0, stage(0, 5.0, 1))).stages[0].replicas
    peak = policy.decide(snap(1.0, stage(0, 40.0, low)))
    high = peak.stages[0].replicas
    assert high >= servers_for_target(40.0, 10.0, 0.2, 0.95, 12) > low
    assert peak.key_stages == (0,)
    replicas = high
    for t in range(2, 12):  # the peak is still in the 10 s window: nothing goes
        replicas = policy.decide(snap(float(t), stage(0, 5.0, replicas))).stages[0].replicas
        assert replicas == high
    seen = []
    for t in range(12, 30):  # out of the window at t = 11.x; then 5 s of hold, then at most 2 per step
        replicas = policy.decide(snap(float(t), stage(0, 5.0, replicas))).stages[0].replicas
        seen.append(replicas)
    assert seen[:4] == [high] * 4
    assert seen[-1] == low
    assert all(a - b <= 2 for a, b in zip(seen, seen[1:], strict=False))


def test_the_hold_is_sized_to_the_replica_start_time() -> None:
    def replicas_after(start_s: float, seconds: int) -> int:
        policy = quiet(provision={"rate_window_s": 0.5, "peak_window_s": 0.5, "hold_min_s": 2.0, "hold_starts": 10.0})
        r = policy.decide(snap(0.0, stage(0, 40.0, 1, replica_start_s=start_s))).stages[0].replicas
        for t in range(1, seconds + 1):
            r = policy.decide(snap(float(t), stage(0, 5.0, r, replica_start_s=start_s))).stages[0].replicas
        return r

    # a 30 ms fork: the 2 s minimum hold, the reserve gone after its taper of (e − 1) × 2 s (policies.keepalive)
    assert replicas_after(0.03, 9) == replicas_after(0.03, 40) < replicas_after(0.03, 1)
    # a 1 s start: all of it held 10 s, then tapered off over 17.2 s
    assert replicas_after(1.0, 5) == replicas_after(1.0, 1)
    assert replicas_after(1.0, 12) > replicas_after(1.0, 30) == replicas_after(1.0, 40)


def test_every_stage_is_sized_for_the_entry_stages_peak() -> None:
    # the entry stage sees a burst the later stages have not received yet: they are raised in the same step
    d = quiet().decide(snap(0.0, stage(0, 40.0, 1), stage(1, 2.0, 1), stage(2, 2.0, 1)))
    need = servers_for_target(40.0, 10.0, 0.2, 0.95, 12)
    assert [s.replicas for s in d.stages] == [need] * 3
    assert d.key_stages == (0, 1, 2)
    off = quiet(provision={"feed_forward": False}).decide(snap(0.0, stage(0, 40.0, 1), stage(1, 2.0, 1)))
    assert off.stages[1].replicas < need


def test_a_backlog_counts_only_when_it_outlasts_the_start_time() -> None:
    # 2 req/s, one 10/s replica: the rate needs 1; a queue of 8 drains in 0.8 s
    short = stage(0, 2.0, 1, queue_len=8, replica_start_s=0.5)  # 0.8 s < 2 × 0.5 s: ignored
    assert quiet().decide(snap(0.0, short)).stages[0].replicas == 1
    long = stage(0, 2.0, 1, queue_len=30, replica_start_s=0.5)  # 3 s > 1 s: drain it within 1 s
    d = quiet().decide(snap(0.0, long)).stages[0]
    assert d.replicas >= 4 and "backlog" in d.reason


def test_the_stages_after_a_backlog_are_sized_for_what_it_will_serve() -> None:
    # a 30-request queue with 1 ready replica: the entry stage asks for more to drain it within 2 starts; the next
    # stage, asked in the same step, is sized (ρ ≤ 0.95) for the rate the entry stage serves once its new replicas
    # are ready, not for the one replica ready now (issue 32, the start of BERT CV 8 seed 0)
    d = quiet().decide(snap(0.0, stage(0, 2.0, 1, queue_len=30), stage(1, 2.0, 1)))
    up = d.stages[0].replicas
    assert up >= 4 and "backlog" in d.stages[0].reason
    assert d.stages[1].replicas >= up and "upstream backlog" in d.stages[1].reason
    off = quiet(provision={"propagate_backlog": False}).decide(snap(0.0, stage(0, 2.0, 1, queue_len=30), stage(1, 2.0, 1)))
    assert off.stages[1].replicas < up


def test_never_below_busy_replicas_nor_above_the_maximum() -> None:
    policy = quiet(provision={"rate_window_s": 0.5, "peak_window_s": 0.5, "hold_min_s": 0.0, "hold_starts": 0.0})
    assert policy.decide(snap(0.0, stage(0, 500.0, 1))).stages[0].replicas == 12
    d = policy.decide(snap(1.0, stage(0, 0.5, 12, busy=11))).stages[0].replicas
    assert d == 11  # demand is 1, two per step at most would give 10, but 11 are busy
    assert policy.decide(snap(2.0, stage(0, 0.5, 11, busy=0))).stages[0].replicas == 9


def test_a_full_cluster_is_learned_only_once_a_start_time_was_measured() -> None:
    # asks pending for 5 s with no start measured yet (a cold start of tens of seconds): not a full cluster
    cold = dict(replica_start_s=-1.0)
    policy = quiet()
    kw = dict(queue_len=0)
    for t in range(6):
        policy.decide(snap(float(t), stage(0, 40.0, 1, pending_replicas=5, **cold, **kw),
                           stage(1, 40.0, 1, pending_replicas=5, **cold, **kw)))
    assert policy.provisioner.capacity is None
    # the same wait with a measured 0.5 s start: the cluster holds what is ready (2), shared fairly
    policy = quiet()
    decision = None
    for t in range(6):
        decision = policy.decide(snap(float(t), stage(0, 40.0, 3, pending_replicas=3), stage(1, 40.0, 1, pending_replicas=5)))
    assert policy.provisioner.capacity == 4
    assert [d.replicas for d in decision.stages] == [2, 2]


def test_fair_shares_water_fill_by_service_time() -> None:
    from gateway_plugin.policies.provision import fair_shares

    stages = (stage(0, 1.0, 1, service_rate=10.0), stage(1, 1.0, 1, service_rate=5.0), stage(2, 1.0, 1))
    assert fair_shares(stages, [2, 3, 2], 12) == [2, 3, 2]  # fits: unchanged
    assert fair_shares(stages, [1, 12, 12], 9) == [1, 5, 3]  # stage 0 keeps 1; 8 left split 2:1, remainder to the largest


def test_the_gg_c_option_sizes_bursty_arrivals_for_their_longer_wait() -> None:
    from gateway_plugin.policies.provision import burst_factor

    assert burst_factor(4.0, 0.0) == 1.0  # off: the M/M/c wait
    assert burst_factor(1.0, 2.0) == 1.0 and burst_factor(0.3, 2.0) == 1.0  # never below M/M/c's own Poisson case
    assert burst_factor(4.0, 2.0) == pytest.approx(2.5)  # (min(CV_a, cap)² + 1) / 2
    assert burst_factor(1.5, 2.0) == pytest.approx(1.625)
    bursty, poisson = stage(0, 25.0, 1, cv_arrival=4.0, target_s=0.13), stage(0, 25.0, 1, cv_arrival=1.0, target_s=0.13)
    on = {"arrival_cv_cap": 2.0}
    assert quiet(provision=on).decide(snap(0.0, poisson)).stages[0].replicas == \
        quiet().decide(snap(0.0, poisson)).stages[0].replicas
    assert quiet(provision=on).decide(snap(0.0, bursty)).stages[0].replicas > \
        quiet().decide(snap(0.0, bursty)).stages[0].replicas
