"""The burst reserve's keep-alive (gateway_plugin.policies.keepalive): fractional ski rental at the step's spend."""

from __future__ import annotations

import math

import pytest
from gateway_plugin.policies import make_policy
from gateway_plugin.policies.keepalive import release_horizon_s, released_share, replicas_kept
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot


def test_the_released_share_goes_from_nothing_to_everything_over_the_horizon() -> None:
    hold = 30.0
    horizon = release_horizon_s(hold)
    assert horizon == pytest.approx((math.e - 1) * hold)
    assert released_share(0.0, hold) == 0.0
    assert released_share(horizon, hold) == 1.0 and released_share(10 * horizon, hold) == 1.0
    shares = [released_share(k * horizon / 100, hold) for k in range(101)]
    assert all(b > a for a, b in zip(shares, shares[1:], strict=False))  # strictly more as time goes on
    assert released_share(horizon / 2, hold) == pytest.approx((math.sqrt(math.e) - 1) / (math.e - 1))
    assert released_share(hold, hold) < 0.5  # by the step rule's release time less than half is gone


@pytest.mark.parametrize("reserve", [1, 2, 5, 11])
def test_the_reserve_costs_what_holding_it_for_the_hold_costs(reserve: int) -> None:
    hold, dt = 30.0, 0.05
    spent = sum(replicas_kept(reserve, 0, k * dt, hold) for k in range(int(release_horizon_s(hold) / dt) + 2)) * dt
    # ∫ Δ·(1 − F) = Δ·T/(e − 1) = Δ·hold; rounding to the nearest replica costs at most 7 % on a reserve of one
    assert spent == pytest.approx(reserve * hold, rel=0.07)
    if reserve >= 5:
        assert spent == pytest.approx(reserve * hold, rel=0.02)


def test_kept_replicas_stay_between_the_demand_and_the_count_it_fell_from() -> None:
    hold = 20.0
    kept = [replicas_kept(6, 2, t / 2, hold) for t in range(0, 200)]
    assert kept[0] == 6 and kept[-1] == 2
    assert all(2 <= k <= 6 for k in kept)
    assert all(b <= a for a, b in zip(kept, kept[1:], strict=False))
    assert replicas_kept(3, 5, 1.0, hold) == 5  # demand above the old count: no reserve, the demand
    assert replicas_kept(4, 1, 0.0, 0.0) == 1  # no hold: nothing kept


def test_a_burst_returning_after_the_hold_finds_part_of_the_reserve() -> None:
    # the step rule has released all of it by then; ski rental still keeps a part, and keeps something until
    # (e − 1) × hold
    hold = 30.0
    assert replicas_kept(6, 1, 1.2 * hold, hold) >= 3
    assert replicas_kept(6, 1, 1.6 * hold, hold) >= 2
    assert replicas_kept(6, 1, release_horizon_s(hold) + 0.1, hold) == 1


KW = dict(service_rate=10.0, target_s=0.2, max_replicas=12, replica_start_s=0.5)


def _snap(t: float, rate: float, replicas: int) -> PipelineSnapshot:
    s = StageSnapshot(**KW, name="m-stage-0", index=0, arrival_rate=rate, arrival_rate_recent=rate, replicas=replicas)
    return PipelineSnapshot(time=t, model="m", stages=(s,))


def _after_a_burst(**provision) -> list[int]:
    cfg = {"rate_window_s": 0.5, "peak_window_s": 0.5, "hold_min_s": 10.0, "hold_starts": 0.0,
           "startup_estimate": False, **provision}
    policy = make_policy("quart", smooth={"enabled": False}, provision=cfg)
    r = policy.decide(_snap(0.0, 40.0, 1)).stages[0].replicas
    out = [r]
    for t in range(1, 40):
        r = policy.decide(_snap(float(t), 2.0, r)).stages[0].replicas
        out.append(r)
    return out


def test_the_provisioner_releases_the_reserve_as_ski_rental() -> None:
    ski, step = _after_a_burst(), _after_a_burst(ski_rental_tail=False)
    top, low = ski[0], ski[-1]
    assert top == step[0] and low == step[-1] and top - low >= 4
    assert step[1:11] == [top] * 10 and step[12] == low  # the step: all held 10 s, then gone (two per second)
    assert ski[5] < top  # ski rental: the first replica leaves early ...
    assert ski[12] > low and ski[15] > low  # ... and part of the reserve outlives the step's
    assert ski.index(low) <= math.ceil(release_horizon_s(10.0)) + 2
    assert sum(ski) == pytest.approx(sum(step), rel=0.08)  # at the same spend
    assert all(b <= a for a, b in zip(ski[1:], ski[2:], strict=False))
