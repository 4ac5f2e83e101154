"""A re-cut on the stage side (quart_stage.kvcache / kvmigrate / kvroutes): the cache of a split's first rest layers
is pre-copied to the live replica beside the session's part while it goes on stepping (``X-Quart-KV-Staged``), the
positions since copied after (``X-Quart-Session-From``) widen the part, and the whole replica drops those layers
(``DELETE .../kv?layers=``): the charges follow, and every refusal names what is wrong and changes nothing."""

from __future__ import annotations

import pytest
from quart_stage import kvmigrate
from quart_stage.errors import QuartError
from quart_stage.kvcache import SessionTable
from quart_stage.kvmigrate import EmulatedKV, block_layers

STAGE, TOTAL, NEED = (0, 10), 10, 100  # embeddings, 8 blocks, head; a session books 100 positions


def _step(table: SessionTable, sid: str, pos: int, ids: list[int], span: tuple[int, int]) -> None:
    with table.step(sid, pos, len(ids), NEED, lambda: EmulatedKV(7, 4), span, STAGE) as s:
        s.state.append(ids, block_layers(span, TOTAL))


def _copy(src: SessionTable, sid: str, span: tuple[int, int], start: int = 0):
    with src.holding(sid) as s:
        body = kvmigrate.encode(sid, s.tokens, span, kvmigrate.cache_tensors(s.state, span, TOTAL, start), 7, start)
        return body, s.tokens


def test_a_pre_copy_waits_beside_the_part_the_rest_widens_it_and_the_whole_replica_drops_the_layers():
    live, whole = SessionTable(1000, 60, sweeper=False), SessionTable(1000, 60, sweeper=False)
    _step(live, "s", 0, [1, 2, 3], (0, 3))
    _step(whole, "s", 0, [1, 2, 3], (3, 10))
    assert (live.used, whole.used) == (30, 70)  # each part its share of the 100 booked

    body, tokens = _copy(whole, "s", (3, 6))  # the pre-copy of layers 3-6 at 3 positions
    tensors, _ = kvmigrate.decode(body, "s", tokens)
    live.adopt("s", tokens, NEED, lambda: None, lambda st: kvmigrate.install(st, tensors, tokens), (0, 6), STAGE,
               staged=True)
    assert live.used == 60  # charged the wider part already; it still steps as 0-3
    _step(live, "s", 3, [4], (0, 3))
    _step(whole, "s", 3, [4], (3, 10))
    with pytest.raises(QuartError) as exc:  # the rest's positions from the wrong place: nothing changes
        bad, n = _copy(whole, "s", (3, 6), 2)
        t, _ = kvmigrate.decode(bad, "s", n, 2)
        live.adopt("s", n, NEED, lambda: None, lambda st: kvmigrate.install(st, t, n, range(1, 6), 2), (0, 6), STAGE)
    assert exc.value.status == 409 and "other than 2 positions" in exc.value.message

    body, n = _copy(whole, "s", (3, 6), tokens)  # the positions since: 1
    tensors, _ = kvmigrate.decode(body, "s", n, tokens)
    live.adopt("s", n, NEED, lambda: None, lambda st: kvmigrate.install(st, tensors, n, block_layers((0, 6), TOTAL),
                                                                         tokens), (0, 6), STAGE)
    whole.trim("s", (3, 6), STAGE, lambda st: kvmigrate.drop(st, (3, 6), TOTAL))
    assert (live.used, whole.used) == (60, 40)
    _step(live, "s", 4, [5], (0, 6))  # the parts meet at layer 6 now
    _step(whole, "s", 4, [5], (6, 10))
    with live.holding("s") as s:
        assert sorted(s.state.layers) == [1, 2, 3, 4, 5] and all(k.shape[-2] == 5 for k, _ in s.state.layers.values())
    with whole.holding("s") as s:
        assert sorted(s.state.layers) == [6, 7, 8]


def test_a_trim_must_drop_a_proper_first_part_and_a_staged_install_needs_the_session():
    table = SessionTable(1000, 60, sweeper=False)
    _step(table, "s", 0, [1, 2], (3, 10))
    for drop in ((4, 6), (3, 10)):  # not its first layers; all of them
        with pytest.raises(QuartError) as exc:
            table.trim("s", drop, STAGE, lambda st: None)
        assert exc.value.status == 409
    assert table.used == 70
    with pytest.raises(QuartError) as exc:
        table.trim("nobody", (3, 4), STAGE, lambda st: None)
    assert exc.value.status == 404
    with pytest.raises(QuartError) as exc:
        table.adopt("new", 2, NEED, lambda: EmulatedKV(7, 4), lambda st: None, (0, 6), STAGE, staged=True)
    assert exc.value.status == 409 and table.used == 70
