"""The one pick rule the gateway's proxy and the pipeline router share (quart_kernel.picking.pick)."""

from __future__ import annotations

from gateway_plugin.router import Router, StaticReplica, StaticReplicas
from quart_kernel.picking import pick


def _replicas(*loads: int) -> list[StaticReplica]:
    return [StaticReplica(f"r{i}", f"http://r{i}", load) for i, load in enumerate(loads)]


def test_least_in_flight_first_and_first_listed_on_a_tie():
    a, b, c = _replicas(2, 1, 1)
    assert pick([a, b, c], 4) is b


def test_concurrency_is_a_per_replica_limit_and_zero_means_unlimited():
    busy = _replicas(3, 3)
    assert pick(busy, 3) is None
    assert pick(busy, 0) is busy[0]  # OpenFaaS max_inflight: 0 = no limit
    assert pick([], 0) is None


def test_tried_replicas_go_last_but_are_used_when_nothing_else_is_free():
    a, b = _replicas(0, 2)
    assert pick([a, b], 4, tried={"r0"}) is b
    assert pick([a, b], 2, tried={"r0"}) is a  # b is full: a retry goes back to a rather than wait


def test_router_and_gateway_pick_alike():
    source = StaticReplicas({"s": _replicas(1, 0)}, slots=0)
    router = Router(source, lambda: {})
    assert router.pick("s", set()) is pick(source.ready("s"), 0)
    source.slots = 1  # r0 is full: only r1 has a slot, tried or not
    assert router.pick("s", {"r1"}) is source.replicas["s"][1]
    source.replicas["s"][1].in_flight = 1
    assert router.pick("s", set()) is None
