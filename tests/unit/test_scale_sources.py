"""Scale-up sources (issues 16 and 17): the ParaServe planner and the start-mode rule the gateway and the
simulator share (quart_kernel.scheduling.paraserve / .starts). Pure functions, no processes."""

from __future__ import annotations

import math

import pytest
from quart_kernel.scheduling import FetchHost, ParaServeCosts, Placement, plan_parallelism, plan_starts
from quart_kernel.scheduling.paraserve import predict, rank_hosts

GB = 1_000_000_000
NIC = 1.25e9  # 10 Gbit/s


def _hosts(n: int, rate: float = NIC) -> list[FetchHost]:
    return [FetchHost(f"h{i}", rate) for i in range(n)]


def _costs(**kw) -> ParaServeCosts:
    base = dict(registry_bytes_s=100e9, h2d_bytes_s=16e9, fixed_s=0.5, hop_s=0.002, service_s=0.1)
    base.update(kw)
    return ParaServeCosts(**base)


def test_predicted_first_response_falls_with_parts_and_pays_a_hop_per_part() -> None:
    costs = _costs()
    one = predict(4 * GB, [NIC], costs)[0]
    four = predict(4 * GB, [NIC] * 4, costs)[0]
    assert one == pytest.approx(0.5 + 4 * GB / NIC + 4 * GB / 16e9 + 0.1)
    assert four == pytest.approx(0.5 + GB / NIC + GB / 16e9 + 0.1 + 3 * 0.002)
    # consolidation: every worker ends up with the whole stage
    _, fetch, consolidated = predict(4 * GB, [NIC] * 4, costs)
    assert consolidated == pytest.approx(fetch + 3 * GB / NIC + 3 * GB / 16e9)


def test_uneven_layers_are_predicted_from_the_largest_part_and_tail_counts() -> None:
    """Four equal layers do not split evenly in three: the slowest worker fetches two of them (half the stage),
    so P = 3 is predicted as P = 2 is and an SLO that an even split would meet needs P = 4; ``tail_s`` adds."""
    layers = [GB // 4] * 4
    costs = _costs(h2d_bytes_s=math.inf, fixed_s=0.0, hop_s=0.0, service_s=0.0)
    even = plan_parallelism(GB, 0.3, _hosts(4), costs)
    assert even.parts == 3 and even.first_response_s == pytest.approx(GB / 3 / NIC)
    plan = plan_parallelism(GB, 0.3, _hosts(4), costs, layer_bytes=layers)
    assert plan.parts == 4 and plan.first_response_s == pytest.approx(GB / 4 / NIC)
    assert plan_parallelism(GB, 10.0, _hosts(4), costs, layer_bytes=layers).first_response_s == pytest.approx(GB / NIC)
    tailed = plan_parallelism(GB, 0.3, _hosts(4), _costs(h2d_bytes_s=math.inf, fixed_s=0.0, hop_s=0.0,
                                                         service_s=0.0, tail_s=0.2), layer_bytes=layers)
    assert not tailed.meets_slo and tailed.first_response_s == pytest.approx(GB / 4 / NIC + 0.2)


def test_smallest_p_that_meets_the_slo() -> None:
    costs = _costs()
    # 4 GB at 10 Gbit/s: P=1 → 3.95 s, P=2 → 2.23 s, P=3 → 1.66 s, P=4 → 1.36 s
    plan = plan_parallelism(4 * GB, 2.0, _hosts(8), costs)
    assert plan.parts == 3 and plan.meets_slo
    assert plan.first_response_s <= 2.0
    assert plan_parallelism(4 * GB, 10.0, _hosts(8), costs).parts == 1


def test_p_is_bounded_by_hosts_and_an_impossible_slo_gives_the_fastest_plan() -> None:
    plan = plan_parallelism(4 * GB, 0.01, _hosts(3), _costs())
    assert plan.parts == 3 and not plan.meets_slo
    assert len(plan.hosts) == 3 == len(set(plan.hosts))
    assert plan_parallelism(4 * GB, 0.01, _hosts(8), _costs(), max_parts=2).parts == 2
    # the same host twice is one host
    assert plan_parallelism(4 * GB, 0.01, [FetchHost("a", NIC), FetchHost("a", NIC)], _costs()).parts == 1


def test_the_registry_bandwidth_caps_parallelism_gains() -> None:
    slow_registry = _costs(registry_bytes_s=NIC)  # the registry, not the NICs, is the limit
    one = plan_parallelism(4 * GB, 0.01, _hosts(1), slow_registry)
    four = plan_parallelism(4 * GB, 0.01, _hosts(4), slow_registry, max_parts=4)
    # the P fetches share one registry: the fetch takes as long as one host's (only the copy to the device
    # is split), where with a fast registry four parts take about a quarter of the time
    assert four.first_response_s > 0.9 * one.first_response_s
    fast = plan_parallelism(4 * GB, 0.01, _hosts(4), _costs(), max_parts=4)
    assert fast.first_response_s < 0.4 * one.first_response_s


def test_placement_avoids_busy_nics_and_nics_already_fetching() -> None:
    hosts = [FetchHost("a", NIC), FetchHost("b", NIC, fetching=1), FetchHost("c", NIC), FetchHost("d", 2 * NIC)]
    ranked = [h.name for h in rank_hosts(hosts, busy_links={("x", "d")})]
    assert ranked == ["a", "c", "b", "d"]  # d serves traffic in, b shares its NIC with a cold fetch
    plan = plan_parallelism(4 * GB, 0.01, hosts, _costs(), busy_links={("x", "d")}, max_parts=2)
    assert plan.hosts == ("a", "c")
    # with d quiet it is the fastest NIC and goes first
    assert rank_hosts(hosts)[0].name == "d"


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="hosts"):
        plan_parallelism(GB, 1.0, [], _costs())
    with pytest.raises(ValueError, match="stage_bytes"):
        plan_parallelism(-1, 1.0, _hosts(2), _costs())
    with pytest.raises(ValueError, match="max_parts"):
        plan_parallelism(GB, 1.0, _hosts(2), _costs(), max_parts=0)
    assert math.isinf(predict(GB, [0.0], _costs())[0])


# ----------------------------------------------------------------------------------- start modes


def _pl(fn: str, host: str, source: str) -> Placement:
    return Placement(fn, host, source)  # type: ignore[arg-type]


def test_without_mechanisms_a_peer_start_is_a_registry_cold_start() -> None:
    plans = plan_starts([_pl("f", "h1", "peer"), _pl("f", "h0", "fork")], {"f": ["h0"]})
    assert [p.mode for p in plans] == ["cold", "fork"]


def test_peer_fetch_receivers_on_one_source_share_its_nic() -> None:
    placements = [_pl("f", f"r{i}", "peer") for i in range(3)]
    plans = plan_starts(placements, {"f": ["s0"]}, {"peer"})
    assert {(p.mode, p.source, p.sharers) for p in plans} == {("peer", "s0", 3)}
    plans = plan_starts(placements, {"f": ["s0", "s1"]}, {"peer"})
    assert sorted((p.source, p.sharers) for p in plans) == [("s0", 2), ("s0", 2), ("s1", 1)]


def test_multicast_chains_receivers_and_live_needs_a_serving_replica() -> None:
    placements = [_pl("f", h, "peer") for h in ("r2", "r0", "r1")]
    plans = plan_starts(placements, {"f": ["s"]}, {"peer", "multicast"})
    assert {p.host: (p.mode, p.source, p.position) for p in plans} == {
        "r0": ("multicast", "s", 1), "r1": ("multicast", "s", 2), "r2": ("multicast", "s", 3)}
    live = plan_starts(placements, {"f": ["s"]}, {"peer", "multicast", "live"}, serving={"f": 1})
    assert {p.mode for p in live} == {"live"} and sorted(p.position for p in live) == [1, 2, 3]
    no_replica = plan_starts(placements, {"f": ["s"]}, {"peer", "multicast", "live"}, serving={"f": 0})
    assert {p.mode for p in no_replica} == {"multicast"}
    # two sources: two chains (multi-chain), each from its own source
    two = plan_starts(placements, {"f": ["s", "t"]}, {"peer", "multicast"})
    assert sorted((p.source, p.position) for p in two) == [("s", 1), ("s", 2), ("t", 1)]


def test_paraserve_groups_cold_replicas_on_distinct_hosts() -> None:
    placements = [_pl("f", h, "cold") for h in ("a", "b", "c", "d", "e")]
    plans = plan_starts(placements, {}, {"paraserve"}, parts={"f": 2})
    modes = [(p.host, p.mode, p.group) for p in plans]
    assert modes[:4] == [("a", "paraserve", ("a", "b")), ("b", "paraserve", ("a", "b")),
                         ("c", "paraserve", ("c", "d")), ("d", "paraserve", ("c", "d"))]
    assert modes[4] == ("e", "cold", ())  # a group of one is a plain cold start
    assert [p.mode for p in plan_starts(placements, {}, {"paraserve"})] == ["cold"] * 5  # P = 1: no split
    # a peer start with the network mechanisms off is cold, so ParaServe may split it
    para = plan_starts([_pl("f", "a", "peer"), _pl("f", "b", "peer")], {"f": ["s"]}, {"paraserve"},
                       parts={"f": 2})
    assert {p.mode for p in para} == {"paraserve"}


def test_unknown_mechanism_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        plan_starts([], {}, {"teleport"})


def test_a_small_paraserve_group_borrows_spare_hosts_once_each() -> None:
    plans = plan_starts([_pl("f", "a", "cold"), _pl("g", "b", "cold")], {}, {"paraserve"},
                        parts={"f": 3, "g": 3}, spare_hosts=["a", "x", "y", "z"])
    by_fn = {p.function: p for p in plans}
    assert by_fn["f"].group == ("a", "x", "y") and by_fn["f"].helpers == ("x", "y")  # "a" is in the batch
    assert by_fn["g"].group == ("b", "z") and by_fn["g"].helpers == ("z",)  # what was left
    lone = plan_starts([_pl("f", "a", "cold")], {}, {"paraserve"}, parts={"f": 3})
    assert lone[0].mode == "cold"  # no spare host: nothing to split over


def test_chains_and_peers_the_gateway_orders_from_the_start_plans():
    from quart_kernel.scheduling.starts import chains_of, peers_of, plan_starts
    from quart_kernel.scheduling.types import Placement

    placements = [Placement("f", h, "peer") for h in ("h3", "h1", "h2")] + [Placement("g", "h4", "peer"),
                                                                           Placement("k", "h5", "cold")]
    plans = plan_starts(placements, {"f": ["h0"], "g": ["h0"]}, {"peer", "multicast"})
    chains = chains_of(plans)
    assert chains == [("f", ("h0", "h1", "h2", "h3"))]  # g has one receiver: no chain
    peers = {(p.function, p.host): peers_of(p, chains) for p in plans}
    assert peers == {("f", "h1"): ("h0",), ("f", "h2"): ("h1", "h0"), ("f", "h3"): ("h2", "h0"),
                     ("g", "h4"): ("h0",), ("k", "h5"): ()}
