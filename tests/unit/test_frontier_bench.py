"""`quartctl bench frontier`'s options: checked before anything starts; static's count per run."""

from __future__ import annotations

import pytest
from quart_tools.bench.frontier import _parser, _policies_args, run


def test_bad_policies_and_static_counts_are_refused_before_the_gateway_starts() -> None:
    for argv in (["--policies", "static"], ["--policies", "nope"], ["--static-k", "0"], ["--static-k", "7"],
                 ["--static-k", ""]):
        with pytest.raises(ValueError, match="--static-k"):
            run(_parser().parse_args(argv))


def test_each_run_gets_its_static_count_and_the_paper_setup() -> None:
    args = _parser().parse_args(["--workloads", "gamma-cv4", "--policies", "", "--static-k", "2,3", "--duration", "120"])
    ns = _policies_args(args, 3)
    assert ns.static_replicas == 3 and ns.duration == 120.0 and ns.baselines_keysmanager == "off"
    assert ns.policy_config == [] and ns.start_replicas == 1
