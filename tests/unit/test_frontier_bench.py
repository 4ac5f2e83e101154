"""`quartctl bench frontier`'s options: checked before anything starts; each run's settings; the dry run."""

from __future__ import annotations

import pytest
from quart_tools.bench.frontier import _parser, _policies_args, main, planned, run
from quart_tools.bench.frontier_plan import PlannedRun


def test_bad_policies_and_static_counts_are_refused_before_the_gateway_starts() -> None:
    for argv in (["--policies", "static"], ["--policies", "nope"], ["--static-k", "0"], ["--static-k", "7"],
                 ["--static-k", ""]):
        with pytest.raises(ValueError, match="--static-k"):
            run(_parser().parse_args(argv))


def test_each_run_gets_its_static_count_keysmanager_and_the_paper_setup() -> None:
    args = _parser().parse_args(["--workloads", "gamma-cv4", "--policies", "", "--static-k", "2,3", "--duration", "120"])
    ns = _policies_args(args, PlannedRun("gamma-cv4", "static-3", "static", 3, True, 0))
    assert ns.static_replicas == 3 and ns.duration == 120.0 and ns.baselines_keysmanager == "on"
    assert ns.policy_config == []
    ns = _policies_args(args, PlannedRun("gamma-cv4", "openfaas-ce", "openfaas-ce", 1, False, 0))
    assert ns.start_replicas == 1 and ns.baselines_keysmanager == "off"


def test_the_plan_is_the_run_list_the_bench_executes() -> None:
    args = _parser().parse_args(["--workloads", "gamma-cv1,gamma-cv8", "--policies", "quart,infless",
                                 "--static-k", "1,2", "--repeats", "2", "--baselines-keysmanager", "both"])
    runs, ks = planned(args)
    assert ks == {"gamma-cv1": [1, 2], "gamma-cv8": [1, 2]}
    assert len(runs) == 2 * 2 * 5  # workloads × repeats × (quart, infless, infless+km, static-1, static-2)
    assert [r.label for r in runs[:5]] == ["quart", "infless", "infless+km", "static-1", "static-2"]
    assert [r.label for r in runs[5:10]] == ["infless", "infless+km", "static-1", "static-2", "quart"]


def test_dry_run_prints_the_runs_and_the_wall_time_and_starts_nothing(capsys) -> None:
    assert main(["--dry-run", "--workloads", "gamma-cv4", "--policies", "quart", "--static-k", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "gamma-cv4 round 1: 3 runs: quart, static-1, static-2" in out
    assert "3 runs x 120 s = 360 s of arrivals" in out


def test_auto_static_k_brackets_quarts_simulated_cost() -> None:
    args = _parser().parse_args(["--workloads", "gamma-cv4", "--policies", "quart", "--static-k", "auto",
                                 "--duration", "30"])
    _, ks = planned(args)
    assert 2 <= len(ks["gamma-cv4"]) <= 4 and ks["gamma-cv4"] == sorted(ks["gamma-cv4"])
