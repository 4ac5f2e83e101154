"""ParaServe for generation, the pure parts (issue 29): P chosen from TTFT and TPOT SLOs, and the sliding-window
rule for how many workers a consolidating group keeps."""

from __future__ import annotations

import pytest
from quart_kernel.scheduling.paraserve import FetchHost, ParaServeCosts
from quart_kernel.scheduling.paraserve_gen import (
    GenerationCosts,
    plan_generation,
    predict_generation,
    workers_to_keep,
)

GB = 10**9
NIC = 125e6  # 1 Gbit/s
HOSTS = [FetchHost(f"h{i}", NIC) for i in range(4)]
COSTS = ParaServeCosts(registry_bytes_s=4 * NIC, overlap=True, fixed_s=0.5)
GEN = GenerationCosts(prefill_s_per_token=0.001, decode_s=0.030, hop_s=0.010)


def _plan(ttft_s: float, tpot_s: float, gen: GenerationCosts = GEN):
    return plan_generation(GB, ttft_s, tpot_s, HOSTS, COSTS, gen, prompt_tokens=100, max_parts=4)


def test_prediction_adds_the_prefill_and_a_hop_per_extra_part():
    assert predict_generation(2.0, 4, 100, GEN) == pytest.approx((2.0 + 0.1 + 0.03, 0.03 + 0.03))
    assert GenerationCosts(0.001, 0.03, 0.01, prefill_min_s=0.5).prefill_s(100) == 0.5


def test_the_smallest_p_that_meets_both_slos():
    # P = 1: 8 s fetch; P = 2: 4 s; P = 4: 2 s (+ prefill 0.1 s + hops)
    assert _plan(ttft_s=9.0, tpot_s=0.1).parts == 1
    assert _plan(ttft_s=5.0, tpot_s=0.1).parts == 2
    plan = _plan(ttft_s=2.5, tpot_s=0.1)
    assert (plan.parts, plan.meets_ttft, plan.meets_tpot) == (4, True, True)
    assert plan.hosts == ("h0", "h1", "h2", "h3") and plan.tpot_s == pytest.approx(0.06)


def test_the_tpot_slo_caps_p():
    # TPOT 0.045 s allows one extra hop at most (P ≤ 2): P = 4 would meet the TTFT SLO but decode too slowly
    plan = _plan(ttft_s=2.5, tpot_s=0.045)
    assert (plan.parts, plan.meets_ttft, plan.meets_tpot) == (2, False, True)
    assert _plan(ttft_s=5.0, tpot_s=0.045).parts == 2
    impossible = _plan(ttft_s=5.0, tpot_s=0.01)  # not even P = 1 decodes in time
    assert (impossible.parts, impossible.meets_tpot) == (1, False)


def test_a_slower_prefill_asks_for_more_parts():
    slow = GenerationCosts(prefill_s_per_token=0.02, decode_s=0.03, hop_s=0.01)  # 2 s of prefill
    assert _plan(ttft_s=5.0, tpot_s=0.1).parts == 2  # 4 s fetch + 0.1 s prefill
    assert plan_generation(GB, 5.0, 0.1, HOSTS, COSTS, slow, 100, 4).parts == 3  # 2.67 s fetch + 2 s prefill


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        plan_generation(GB, 1.0, 1.0, [], COSTS, GEN, 100)
    with pytest.raises(ValueError):
        plan_generation(GB, 1.0, 1.0, HOSTS, COSTS, GEN, 0)


def test_sliding_window_keeps_workers_for_the_burst():
    arrivals = [0.5, 1.0, 9.1, 9.5, 9.9]  # three in the last 2 s window
    assert workers_to_keep(arrivals, now=10.0, window_s=2.0, waiting=0, per_worker=8, group_size=4) == 1
    assert workers_to_keep(arrivals, 10.0, 2.0, waiting=6, per_worker=4, group_size=4) == 3  # (6 + 3) / 4
    assert workers_to_keep(arrivals * 10, 10.0, 2.0, waiting=40, per_worker=4, group_size=4) == 4  # capped at P
    assert workers_to_keep([], 10.0, 2.0, 0, 4, 4) == 1  # idle: scale down to one
    with pytest.raises(ValueError):
        workers_to_keep([], 10.0, 0.0, 0, 4, 4)


def test_the_gateway_plans_p_from_both_slos_when_given_a_tpot_slo():
    from quart_kernel.scheduling.types import HostView
    from quart_provider.config import GatewayConfig
    from quart_provider.paraserve_start import ParaServeStarts, StageLayout

    views = [HostView(f"h{i}", 1, 0, 64 << 30, 0) for i in range(4)]
    layout = StageLayout(0, 10, tuple([GB // 10] * 10))
    common = dict(paraserve=True, nic_gbps=1.0, registry_gbps=4.0, paraserve_fixed_s=0.5, paraserve_slo_ms=2500,
                  paraserve_decode_ms=30.0, paraserve_hop_ms=10.0, paraserve_prefill_ms=100.0)
    assert ParaServeStarts(GatewayConfig(**common, paraserve_tpot_slo_ms=100)).parts_for(views, {"f": layout}) == {"f": 4}
    # a TPOT SLO of 45 ms allows one extra part: P = 2 (the earliest TTFT among those that decode in time)
    assert ParaServeStarts(GatewayConfig(**common, paraserve_tpot_slo_ms=45)).parts_for(views, {"f": layout}) == {"f": 2}
