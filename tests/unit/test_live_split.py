"""The booking of a split generation session during a live scale-up (quart_kernel.scheduling.live_split and
gateway_plugin.generation.cooperative.split_for): each part its share, the live replica the rejoin's room only
for a session that outlives the loading, and no split where that does not fit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from gateway_plugin.generation.cooperative import LayerArrivals, split_for
from quart_kernel.scheduling.live_split import (
    admission_rate,
    loading_left_s,
    outlives_loading,
    rejoin_room,
    split_booking,
)

STAGE = (0, 18)  # embeddings, 16 blocks, head


@dataclass
class Replica:
    id: str
    held: tuple[int, int]
    layers: tuple[int, int] = STAGE
    in_flight: int = 0
    state: str = "ready"


@pytest.mark.parametrize(("rejoin", "room"), [("auto", 0), ("migrate", 0), ("shadow", 80), ("replay", 80), ("keep", 0)])
def test_a_session_outliving_the_loading_books_its_rejoins_room_beside_its_share(rejoin, room):
    b = split_booking(80, (0, 6), STAGE, rejoin, outlives=True)
    assert (b.part, b.rest) == (-(-80 * 6 // 18), -(-80 * 12 // 18)) == (27, 54)
    assert b.reserve == rejoin_room(80, 54, rejoin) == room  # a move hands the rest over: nothing ahead
    assert b.live == b.part + b.reserve


def test_a_session_ending_before_the_replica_is_whole_books_its_share_only():
    b = split_booking(80, (0, 9), STAGE, "migrate", outlives=False)
    assert (b.part, b.reserve, b.rest) == (40, 0, 40)


def test_outliving_is_steps_left_times_the_step_against_the_layers_left_at_their_rate():
    left = loading_left_s(6, 18, 4.0)  # 12 layers at 4 a second
    assert left == 3.0
    assert not outlives_loading(16, 0.08, left)  # 1.28 s (1.6 s with the margin) < 3 s
    assert outlives_loading(40, 0.08, left)  # 3.2 s
    assert outlives_loading(32, 0.08, left)  # 2.56 s, but within the margin: the safe side
    assert outlives_loading(16, None, left) and outlives_loading(16, 0.08, None)  # no estimate yet: book the room
    assert loading_left_s(6, 18, None) is None and loading_left_s(18, 18, 2.0) == 0


def test_layer_arrivals_give_a_rate_after_the_held_layers_grew():
    seen = LayerArrivals(10.0, 4, 10.0, 4)
    assert seen.rate() is None
    seen.see(10.5, 4)
    assert seen.rate() is None  # no growth yet
    seen.see(11.0, 8)
    seen.see(11.5, 8)  # not grown since: the rate is from the growth seen
    assert seen.rate() == 4.0


def test_split_for_caps_the_live_replicas_splits_by_its_room_for_the_part_and_a_replays_rejoin():
    live, whole = Replica("live", (0, 9)), Replica("whole", STAGE)
    booked: dict[str, int] = {}

    def room(rid: str) -> int:
        return 480 - booked.get(rid, 0)

    def taken(rejoin: str, outlives: bool) -> int:
        booked.clear()
        n = 0
        while (s := split_for([whole, live], room, 80, rejoin, lambda r: outlives)) is not None:
            assert (s.partial, s.part, s.rest, s.rest_tokens) == (live, (0, 9), (9, 18), 40)
            booked["live"] = booked.get("live", 0) + s.part_tokens
            n += 1
        return n

    assert taken("shadow", True) == 4  # the share and the replay's whole session: 120 positions each
    assert taken("migrate", True) == taken("auto", True) == 12  # a move hands the rest over: the share only
    assert taken("shadow", False) == 12  # sessions that end during the loading: their share only


def test_split_for_takes_the_live_replica_holding_most_and_never_a_whole_one():
    a, b, whole = Replica("a", (0, 5)), Replica("b", (0, 11)), Replica("w", STAGE)
    s = split_for([a, whole, b], lambda rid: 1000, 80, "shadow", lambda r: True)
    assert s.partial is b and s.part == (0, 11) and s.part_tokens == -(-80 * 11 // 18) + 80
    assert split_for([whole], lambda rid: 1000, 80, "shadow", lambda r: True) is None
    assert split_for([Replica("x", (3, 9))], lambda rid: 1000, 80, "shadow", lambda r: True) is None


def test_admission_rate_grows_with_the_live_share_until_the_live_replica_binds() -> None:
    room, whole, split = 6, 1.4, 1.5
    assert admission_rate(0.0, room, whole, split) == pytest.approx(6 / 1.4)
    assert admission_rate(1.0, room, whole, split) == pytest.approx(12 / 1.4)
    assert admission_rate(0.4, room, whole, split) == pytest.approx(6 / (1.5 * 0.6))  # the old replica binds
    # the live one binds: 7.5 splits, the old replica's room left (6 - 7.5 * 0.2) to whole sessions
    assert admission_rate(0.8, room, whole, split) == pytest.approx(7.5 / 1.5 + 4.5 / 1.4)
    assert admission_rate(0.5, room, whole, split) > admission_rate(0.2, room, whole, split)


def _view(**kw):
    from quart_kernel.scheduling.live_split import RecutView

    base = {"gain": 40, "gain_share": 0.3, "steps_left": 10, "live_room": 200, "whole_room": 10, "head_part": 60,
            "head_rest": 30, "waiting": 2}
    return RecutView(**(base | kw))


@pytest.mark.parametrize(("change", "pays"), [
    ({}, True),  # the whole replica lacks the head's rest, the live one has this gain and the head's part
    ({"waiting": 0}, False),  # nobody waits: the move would free room nobody needs
    ({"whole_room": 30}, False),  # the head fits already
    ({"live_room": 90}, False),  # the gain would take the live room the head's part needs
    ({"gain_share": 0.1}, False),  # too little to be worth a move
    ({"steps_left": 2}, False),  # ends too soon to use it
    ({"gain": 0}, False),
])
def test_a_split_is_re_cut_only_where_it_turns_live_room_into_room_the_head_of_the_line_needs(change, pays):
    from quart_kernel.scheduling.live_split import recut_pays

    assert recut_pays(_view(**change)) is pays
