"""The burst reserve's keep-alive (gateway_plugin.policies.keepalive): held for the hold, then a ski-rental taper."""

from __future__ import annotations

import math

import pytest
from gateway_plugin.policies import make_policy
from gateway_plugin.policies.keepalive import release_horizon_s, released_share, replicas_kept
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot


def test_the_released_share_goes_from_nothing_to_everything_over_the_tail() -> None:
    hold = 30.0
    horizon = release_horizon_s(hold)
    assert horizon == pytest.approx((math.e - 1) * hold)
    assert released_share(0.0, hold) == 0.0
    assert released_share(horizon, hold) == 1.0 and released_share(10 * horizon, hold) == 1.0
    shares = [released_share(k * horizon / 100, hold) for k in range(101)]
    assert all(b > a for a, b in zip(shares, shares[1:], strict=False))  # strictly more as time goes on
    assert released_share(horizon / 2, hold) == pytest.approx((math.sqrt(math.e) - 1) / (math.e - 1))


def _step(top: int, demand: int, idle_s: float, hold_s: float) -> int:
    """The step rule: all of the reserve for the hold, none after."""
    return top if idle_s < hold_s else demand


@pytest.mark.parametrize("reserve", [1, 2, 5, 11])
def test_the_taper_costs_one_more_hold(reserve: int) -> None:
    hold, dt = 30.0, 0.05
    end = hold + release_horizon_s(hold)
    spent = sum(replicas_kept(reserve, 0, k * dt, hold) for k in range(int(end / dt) + 2)) * dt
    step = sum(_step(reserve, 0, k * dt, hold) for k in range(int(end / dt) + 2)) * dt
    assert step == pytest.approx(reserve * hold, rel=0.01)
    # hold + ∫ Δ·(1 − F) = Δ·hold + Δ·T/(e − 1) = 2·Δ·hold; rounding to the nearest replica: ≤ 4 % on a reserve of one
    assert spent == pytest.approx(2 * reserve * hold, rel=0.04)
    if reserve >= 5:
        assert spent == pytest.approx(2 * reserve * hold, rel=0.01)


def test_never_fewer_than_the_step_rule_and_never_outside_demand_and_top() -> None:
    hold = 20.0
    kept = [replicas_kept(6, 2, t / 2, hold) for t in range(0, 200)]
    assert kept[0] == 6 and kept[-1] == 2
    assert all(2 <= k <= 6 for k in kept)
    assert all(b <= a for a, b in zip(kept, kept[1:], strict=False))
    assert all(k >= _step(6, 2, t / 2, hold) for t, k in enumerate(kept))
    assert kept[: int(2 * hold)] == [6] * int(2 * hold)  # whole for the hold
    assert replicas_kept(3, 5, 1.0, hold) == 5  # demand above the old count: no reserve, the demand
    assert replicas_kept(4, 1, 0.0, 0.0) == 1  # no hold: nothing kept


def test_a_burst_returning_after_the_hold_finds_part_of_the_reserve() -> None:
    # the step rule has released all of it by then; the taper still keeps most of it just after the hold, a part
    # half-way through its tail, and nothing after (e − 1) × hold more
    hold = 30.0
    tail = release_horizon_s(hold)
    assert replicas_kept(6, 1, 1.2 * hold, hold) >= 5
    assert replicas_kept(6, 1, hold + tail / 2, hold) >= 3
    assert replicas_kept(6, 1, hold + tail + 0.1, hold) == 1


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
    for t in range(1, 50):
        r = policy.decide(_snap(float(t), 2.0, r)).stages[0].replicas
        out.append(r)
    return out


def test_the_provisioner_holds_then_tapers_the_reserve() -> None:
    taper, step = _after_a_burst(), _after_a_burst(ski_rental_tail=False)
    top, low = taper[0], taper[-1]
    assert top == step[0] and low == step[-1] and top - low >= 4
    assert step[1:11] == [top] * 10 and step[12] == low  # the step: all held 10 s, then gone (two per second)
    assert taper[:11] == step[:11]  # the taper: the same hold ...
    assert taper[12] > low and taper[20] > low  # ... then part of the reserve outlives the step's
    assert all(a >= b for a, b in zip(taper, step, strict=True))
    assert taper.index(low) <= 1 + 10 + math.ceil(release_horizon_s(10.0)) + 2
    reserve = [sum(x - low for x in run) for run in (taper, step)]
    assert reserve[0] == pytest.approx(2 * reserve[1], rel=0.15)  # one more hold's worth of reserve
