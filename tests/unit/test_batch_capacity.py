"""The batching capacity model (gateway_plugin.policies.batch_capacity) and the policies that use it."""

from __future__ import annotations

import math

import pytest
from gateway_plugin.batching import BatchLimits, limits_from_labels, parse_profile
from gateway_plugin.config import CorrectConfig
from gateway_plugin.policies.batch_capacity import (
    capacity_rate,
    delay_s,
    fit,
    profile_of,
    service_rate_at,
    work_s,
)
from gateway_plugin.policies.correct import Corrector, stability_floor
from gateway_plugin.policies.queueing import mmc_delay, mmc_wait
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot
from gateway_plugin.snapshot_builder import with_profile
from quart_stage.errors import QuartError

# MiniLM stage 1 as the router measured it (ms of one call by batch size): S(b) ≈ 16 + 14.3·b ms
TABLE = ((1, 40, 0.030), (4, 12, 0.073), (8, 6, 0.130), (16, 3, 0.245))


def _stage(batch_max: int = 16, table=TABLE, rate: float = 10.0, replicas: int = 1, service_rate: float = 1 / 0.030,
           **kw) -> StageSnapshot:
    return StageSnapshot(name="m-1", index=0, arrival_rate=rate, service_rate=service_rate, replicas=replicas,
                         batch_service_s=table, batch_max=batch_max, **kw)


def test_fit_recovers_a_linear_profile_weighted_by_calls() -> None:
    exact = tuple((b, 5, 0.016 + 0.0143 * b) for b in (1, 2, 4, 8, 16))
    p = fit(exact, 16)
    assert p.fixed_s == pytest.approx(0.016) and p.per_request_s == pytest.approx(0.0143)
    assert p.rate(16) == pytest.approx(16 / (0.016 + 0.0143 * 16))
    # one size alone: no evidence of a fixed cost, no gain assumed
    alone = fit(((1, 9, 0.03),), 16)
    assert alone.fixed_s == 0 and alone.rate(16) == pytest.approx(1 / 0.03)
    # a slope the data cannot carry (bigger batches cheaper) falls back to the origin line
    assert fit(((1, 1, 0.05), (8, 1, 0.04)), 8).fixed_s == 0
    assert fit((), 16) is None


def test_expected_batch_grows_with_load_and_stops_at_the_maximum() -> None:
    p = fit(TABLE, 16)
    assert p.expected_batch(0.0, 1) == 1.0
    low, mid = p.expected_batch(5.0, 1), p.expected_batch(40.0, 1)
    assert 1.0 <= low < mid < 16
    assert p.expected_batch(1000.0, 1) == 16  # past capacity: full batches
    # b* is the mean queue a departure sees at b*'s rate: L_q = λ·W_q(λ, μ(b*), c)
    assert mid == pytest.approx(40.0 * mmc_wait(40.0, p.rate(mid), 1), rel=1e-6)
    assert p.expected_batch(0.5 / 0.030, 1) == 1.0  # ρ = 0.5 one at a time: L_q = 0.5 < 1, each goes alone
    assert p.expected_batch(40.0, 4) < mid  # more replicas: smaller batches


def test_a_stage_that_does_not_batch_keeps_the_plain_model() -> None:
    plain = _stage(batch_max=1)
    assert profile_of(plain) is None
    assert capacity_rate(plain) == plain.service_rate == service_rate_at(plain, 50.0, 3)
    for rate, c in ((10.0, 1), (25.0, 1), (50.0, 2)):
        assert delay_s(plain, rate, c) == mmc_delay(rate, plain.service_rate, c)


def test_batching_raises_capacity_and_the_delay_model_follows_the_batch() -> None:
    s = _stage()
    p = profile_of(s)
    assert capacity_rate(s) == pytest.approx(p.rate(16)) and capacity_rate(s) > 1.8 * s.service_rate
    # a load one replica cannot take one at a time (ρ = 1.5) it takes batched, at a finite delay
    assert math.isinf(mmc_delay(50.0, s.service_rate, 1))
    t = delay_s(s, 50.0, 1)
    b = p.expected_batch(50.0, 1)
    assert b > 2 and t >= p.service_s(b) and math.isfinite(t)
    # at light load it is M/M/c at the measured single-call time (b* = 1)
    assert delay_s(s, 0.5, 1) == pytest.approx(mmc_delay(0.5, p.rate(1), 1) + 0 * p.service_s(1), rel=0.02)
    assert math.isinf(delay_s(s, 1.01 * capacity_rate(s), 1))


def test_correct_sizes_a_batching_stage_by_its_batch_capacity() -> None:
    rate = 50.0  # 1.5 × what one replica serves one at a time
    plain, batched = _stage(batch_max=1, rate=rate, replicas=1), _stage(rate=rate, replicas=1)
    assert stability_floor(plain, 0.9) == 2
    assert stability_floor(batched, 0.9) == 1  # 16-batches: ~2× the requests/s of one at a time
    snap = lambda st: PipelineSnapshot(time=100.0, model="m", stages=(st,), slo_s=1.0)  # noqa: E731
    up = Corrector(CorrectConfig()).correct(snap(plain), plain)
    stay = Corrector(CorrectConfig()).correct(snap(batched), batched)
    assert up.replicas >= 2 and stay.replicas == 1, (up.reason, stay.reason)


def test_the_profile_label_seeds_the_table_until_measured() -> None:
    assert parse_profile(" 1:30, 16:245 ") == ((1, 0.030), (16, 0.245))
    assert parse_profile("") == ()
    for bad in ("16", "0:3", "4:-1", "a:b", "2:inf"):
        with pytest.raises(QuartError, match="com.quart.batch.profile-ms"):
            parse_profile(bad)
    default = BatchLimits(4)
    limits = limits_from_labels({"com.quart.batch.max": "16", "com.quart.batch.profile-ms": "1:30,16:245"}, default)
    assert limits == BatchLimits(16, 0.0, ((1, 0.030), (16, 0.245)))
    assert limits_from_labels({"com.quart.batch.profile-ms": "x"}, default) == default
    # measured sizes win; profiled ones fill in with 0 calls
    assert with_profile(((1, 7, 0.02),), ((1, 0.03), (16, 0.245))) == ((1, 7, 0.02), (16, 0, 0.245))


def test_sizing_counts_on_the_batches_that_fit_the_target() -> None:
    s = _stage()
    p = profile_of(s)
    full = capacity_rate(s)
    assert capacity_rate(s, math.inf) == full == pytest.approx(p.rate(16))
    # S(b) ≤ target/2: 0.2 s → b ≤ (0.1 − F)/P = 5
    b = math.floor((0.1 - p.fixed_s) / p.per_request_s)
    assert capacity_rate(s, 0.2) == pytest.approx(p.rate(b)) and capacity_rate(s, 0.2) < full
    assert capacity_rate(s, 0.001) == pytest.approx(p.rate(1))  # not even one fits: one at a time
    # the floor follows: at 50 req/s ρ ≤ 0.9 needs 1 replica at full batches, 2 at the batches a 60 ms target allows
    assert stability_floor(_stage(rate=50.0), 0.9) == 1 < stability_floor(_stage(rate=50.0), 0.9, 0.06)


def test_the_slo_split_weighs_a_batching_stage_by_one_request_not_by_its_calls() -> None:
    from gateway_plugin.policies.correct import stage_target_s
    from gateway_plugin.policies.provision import fair_shares

    # both stages take 30 ms a request alone; the batching one's requests report 16-calls (245 ms) as service
    batching = _stage(service_rate=1 / 0.245)
    plain = StageSnapshot(name="m-0", index=1, arrival_rate=10.0, service_rate=1 / 0.030, replicas=1)
    snap = PipelineSnapshot(time=0.0, model="m", stages=(batching, plain), slo_s=1.0)
    assert work_s(batching) == pytest.approx(profile_of(batching).service_s(1)) and work_s(plain) == pytest.approx(0.03)
    assert stage_target_s(snap, batching, 2.0) == pytest.approx(stage_target_s(snap, plain, 2.0), rel=0.05)
    assert fair_shares((batching, plain), [10, 10], 10) == [5, 5]  # by the call time: 9 to 1
