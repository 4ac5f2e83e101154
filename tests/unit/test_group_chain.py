"""Which part replicas a new session's stage runs on while the stage has only a ParaServe group's parts
(`gateway_plugin.generation.groupsessions.chain_for`): parts that tile the stage in order, each with KV room for
its share of the session's positions."""

from __future__ import annotations

from gateway_plugin.generation.groupsessions import chain_for, part_span
from gateway_plugin.router import StaticReplica

STAGE = (0, 8)


def _parts(*spans, held=None) -> list[StaticReplica]:
    return [StaticReplica(f"p{i}", f"http://p{i}", layers=STAGE, held=held or (a, a), part=(a, b))
            for i, (a, b) in enumerate(spans)]


def test_the_parts_tile_the_stage_in_order_each_booked_its_share() -> None:
    parts = _parts((3, 6), (0, 3), (6, 8))
    chain = chain_for(parts, 80, lambda rid: 1000)
    assert [(r.id, span) for r, span in chain.hops] == [("p1", (0, 3)), ("p0", (3, 6)), ("p2", (6, 8))]
    assert chain.charges == [30, 30, 20]  # kv_charge: 80 positions x its share of the 8 layers, rounded up


def test_no_chain_when_a_part_is_missing_full_or_excluded_or_a_replica_is_whole() -> None:
    parts = _parts((0, 3), (3, 6), (6, 8))
    assert chain_for(parts[:2], 80, lambda rid: 1000) is None  # layers 6-8: nobody
    assert chain_for(parts, 80, lambda rid: 10 if rid == "p1" else 1000) is None  # p1 has no room for 30
    assert chain_for(parts, 80, lambda rid: 1000, excluded={"p2"}) is None
    whole = StaticReplica("w", "http://w", layers=STAGE, held=STAGE)
    assert part_span(whole) is None and chain_for([whole], 80, lambda rid: 1000) is None


def test_without_a_planned_part_the_held_layers_count_and_the_furthest_reach_wins() -> None:
    live = [StaticReplica("a", "http://a", layers=STAGE, held=(0, 5)),
            StaticReplica("b", "http://b", layers=STAGE, held=(0, 2)),
            StaticReplica("c", "http://c", layers=STAGE, held=(4, 8))]
    chain = chain_for(live, 16, lambda rid: 1000)
    assert [(r.id, span) for r, span in chain.hops] == [("a", (0, 5)), ("c", (5, 8))]
