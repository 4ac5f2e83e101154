"""The live frontier's run list and wall-time arithmetic (`quart_tools.bench.frontier_plan`)."""

from __future__ import annotations

import pytest
from quart_tools.bench.frontier_plan import Overheads, bracket_k, format_plan, labels, plan_runs, wall_time_s


def test_the_acceptance_plan_counts_96_runs_with_both_repeats() -> None:
    ws = ["gamma-cv1", "gamma-cv4", "gamma-cv8", "trace"]
    pols = ["quart", "openfaas-ce", "knative-kpa", "inferline", "infless", "cocktail"]
    runs = plan_runs(ws, pols, {w: [1, 2, 3, 4, 5, 6] for w in ws}, repeats=2)
    assert len(runs) == 96
    both = plan_runs(ws, pols, {w: [1, 2, 3, 4, 5, 6] for w in ws}, repeats=2, baselines_keysmanager="both")
    assert len(both) == 136  # + 5 baselines with the KeysManager per workload and repeat
    assert sum(r.keysmanager for r in both) == 4 * 2 * (1 + 5 + 6)


def test_labels_put_quart_and_static_on_the_keysmanager_and_the_baselines_as_asked() -> None:
    out = labels(["quart", "infless"], [2], "off", 1)
    assert out == [("quart", "quart", 1, True), ("infless", "infless", 1, False), ("static-2", "static", 2, True)]
    assert labels(["infless"], [], "on", 1) == [("infless+km", "infless", 1, True)]
    with pytest.raises(ValueError, match="off, on or both"):
        labels(["quart"], [1], "maybe", 1)


def test_wall_time_adds_the_overheads_and_divides_by_runs_side_by_side() -> None:
    o = Overheads(per_run_s=30.0, gateway_start_s=40.0, calibration_s=60.0)
    assert wall_time_s(10, 120.0, o) == 10 * 150.0 + 100.0
    assert wall_time_s(10, 120.0, o, side_by_side=2) == 5 * 150.0 + 100.0
    assert wall_time_s(11, 120.0, o, side_by_side=2) == 6 * 150.0 + 100.0


@pytest.mark.parametrize(("rs", "expected"), [
    (1865.0, [1, 2, 3]),  # 1.94 replicas per stage: close to 2, so 3 as well
    (1700.0, [1, 2]),  # 1.77
    (1000.0, [1, 2]),  # 1.04: nothing below 1
    (2600.0, [2, 3]),  # 2.71
    (5700.0, [5, 6]),  # 5.94: capped at k_max
    (2880.0, [2, 3, 4]),  # exactly 3
])
def test_bracket_k_takes_the_static_counts_around_quarts_cost(rs, expected) -> None:
    assert bracket_k(rs, stages=8, duration_s=120.0, k_max=6) == expected


def test_bracket_k_refuses_a_cost_it_cannot_place() -> None:
    for bad in (0.0, float("nan"), -5.0):
        with pytest.raises(ValueError, match="cannot bracket"):
            bracket_k(bad, 8, 120.0, 6)


def test_format_plan_states_runs_arrivals_and_total() -> None:
    runs = plan_runs(["gamma-cv4"], ["quart"], {"gamma-cv4": [1, 2]}, repeats=1)
    text = format_plan(runs, 120.0, Overheads(per_run_s=20.0, gateway_start_s=40.0, calibration_s=60.0))
    assert text.splitlines()[0] == "gamma-cv4 round 1: 3 runs: quart, static-1, static-2"
    assert "3 runs x 120 s = 360 s of arrivals" in text and "= 520 s (9 min" in text


def test_format_plan_bounds_the_baselines_slow_drains() -> None:
    runs = plan_runs(["trace"], ["quart", "infless"], {"trace": [2]}, repeats=2)
    o = Overheads(per_run_s=5.0, gateway_start_s=20.0, calibration_s=45.0, drain_bound_s=30.0)
    text = format_plan(runs, 120.0, o)
    assert "= 815 s (14 min" in text  # 6 × 125 + 65
    assert "at most 875 s (15 min) if each of the 2 baseline runs drains for 30 s" in text
