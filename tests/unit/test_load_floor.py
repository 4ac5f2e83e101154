"""Rules 8 and 9 of the provisioning corrector (gateway_plugin.policies.load_floor, issue 32)."""

from __future__ import annotations

import math

import pytest
from gateway_plugin.policies import make_policy
from gateway_plugin.policies.load_floor import MIN_FLOOR_SAMPLES, LoadFloor, sizing_rate
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot

KW = dict(service_rate=10.0, target_s=0.2, max_replicas=12, replica_start_s=0.5)


def stage(i: int, recent: float, replicas: int, window: float = 0.0) -> StageSnapshot:
    return StageSnapshot(**KW, name=f"m-stage-{i}", index=i, arrival_rate=window, arrival_rate_recent=recent,
                         replicas=replicas)


def test_the_floor_is_mean_plus_z_sd_of_the_window_means_once_it_has_enough() -> None:
    floor = LoadFloor(horizon_s=100.0, z=2.0)
    values = [10.0 if k % 2 else 20.0 for k in range(MIN_FLOOR_SAMPLES)]
    for k, v in enumerate(values[:-1]):
        floor.add(float(k), v)
    assert floor.rate() == 0.0  # too few samples: the start-up estimate speaks
    floor.add(float(len(values) - 1), values[-1])
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    assert floor.rate() == pytest.approx(mean + 2.0 * sd)
    for k in range(200, 200 + MIN_FLOOR_SAMPLES):  # the old samples leave the horizon
        floor.add(float(k), 5.0)
    assert floor.rate() == pytest.approx(5.0)
    assert LoadFloor(horizon_s=0.0, z=2.0).rate() == 0.0  # off


def test_a_later_stage_is_sized_for_the_entry_peak_not_its_own() -> None:
    assert sizing_rate(50.0, 40.0, 30.0, is_entry=False, entry_only=True) == 40.0
    assert sizing_rate(50.0, 40.0, 30.0, is_entry=True, entry_only=True) == 50.0
    assert sizing_rate(50.0, 40.0, 30.0, is_entry=False, entry_only=False) == 50.0  # rule 2 alone: the max
    assert sizing_rate(50.0, 0.0, 30.0, is_entry=False, entry_only=True) == 50.0  # no entry peak yet
    assert sizing_rate(10.0, 40.0, 60.0, is_entry=False, entry_only=True) == 60.0  # its window rate still counts


def _run(policy, rates: list[tuple[float, float]], replicas: int = 1) -> list[int]:
    """Feed per-second (entry, later stage) recent rates; return the later stage's count each second."""
    out, counts = [], [replicas, replicas]
    for t, (entry, later) in enumerate(rates):
        d = policy.decide(PipelineSnapshot(time=float(t), model="m",
                                           stages=(stage(0, entry, counts[0]), stage(1, later, counts[1]))))
        counts = [s.replicas for s in d.stages]
        out.append(counts[1])
    return out


def test_a_compressed_burst_at_a_later_stage_asks_nothing_its_entry_did_not() -> None:
    # the entry saw 30 req/s; its queue released 45 req/s to stage 1 for two seconds (a compressed burst)
    rates = [(30.0, 30.0)] * 10 + [(30.0, 45.0)] * 2 + [(30.0, 30.0)] * 3
    prov = {"startup_estimate": False, "floor_horizon_s": 0.0, "hold_min_s": 0.0, "hold_starts": 0.0}
    entry_only = make_policy("quart", smooth={"enabled": False}, provision={**prov, "entry_sizes_pipeline": True})
    own = make_policy("quart", smooth={"enabled": False}, provision=prov)
    assert max(_run(own, rates)) > max(_run(entry_only, rates)) == _run(entry_only, rates)[9]


def test_the_floor_keeps_the_level_through_a_lull_of_a_bursty_stream() -> None:
    # bursts of 60 req/s for 5 s every 40 s over a 10 req/s base: after each burst's peak window and hold the
    # peak rule alone falls to the base level; the floor keeps the level its statistics justify
    rates = [((60.0 if t % 40 < 5 else 10.0),) * 2 for t in range(200)]
    prov = {"startup_estimate": False, "hold_min_s": 5.0, "hold_starts": 0.0, "peak_window_s": 10.0}
    with_floor = _run(make_policy("quart", smooth={"enabled": False}, provision={**prov, "floor_horizon_s": 300.0}),
                      rates)
    without = _run(make_policy("quart", smooth={"enabled": False}, provision=prov), rates)
    lull = range(150, 158)  # the middle of a lull after three bursts
    assert min(with_floor[t] for t in lull) > min(without[t] for t in lull)
