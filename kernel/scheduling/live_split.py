"""How much of a live replica a split generation session may take, and whether it outlives the loading (BlitzScale
§4 with decode, issue 29). Pure.

A session opened while a new replica holds only its stage's first layers runs those layers there and the rest on
a whole replica (``gateway_plugin.generation.cooperative``). Each part is booked its share of the session's KV
positions (``quart_stage.spans.kv_charge``). What the live replica must hold *beside* the part is the room the
rejoin will need once it is whole, and only for a session still running then:

- ``migrate`` / ``auto``: nothing. The move takes the rest's share from the whole replica to the live one: the
  two replicas' total does not change, and the rest's booking is held already (on the whole replica). Booking it
  on the live replica too held each outliving split twice over there: the live replica took at most its cap in
  whole sessions of splits, and during a burst its book was full at f = 0.6 with 7 splits while the line waited
  (issue 29, the bench's timeline). The move waits for room instead (tried before every step; ``auto`` takes a
  background replay where room for one is free); a split that finds none stays split until it ends;
- ``shadow`` / ``replay``: the session is prefilled again there, the whole session beside the part it holds;
- ``keep``: nothing (it stays split until it ends).

A split made early holds most of the session on the whole replica, ``1 - f`` at the ``f`` of its entry, while the
live replica's layers grow. While new sessions wait for room that the whole replica lacks and the live one has, a
split is **re-cut** (`recut_pays`): the cache of the layers the live replica gained since its cut moves onto it
(one KV move, the stream waits for it), and the whole replica's share of them frees for the line: the old replica
then holds about ``1 - f`` of every split at today's ``f``, the fluid bound's booking (`admission_rate`).

A session predicted to end before the replica is whole is booked its share only: the room of the splits that end
during the loading is the new replica's gain, which a booking of the rejoin room for every split gives away (the
measured cost: TTFT 0.72 × stop-the-world's instead of ≤ 0.5). A prediction that misses is safe: the session
rejoins when the room is there, and else stays split until it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from quart_stage.spans import kv_charge

REJOIN_MODES = ("auto", "migrate", "shadow", "replay", "keep")
RECUT_MIN_SHARE = 0.15  # a re-cut moves at least this share of the stage (each costs its stream one KV move)
RECUT_MIN_STEPS = 3  # ... and the session has this many steps left to hold the room it frees
OUTLIVE_MARGIN = 1.25  # a session is taken to outlive the loading unless it ends this much before (estimates err)

Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class SplitBooking:
    """Positions booked for one split session: on the live replica its part and the rejoin's room, on the whole
    replica the rest."""

    part: int
    reserve: int
    rest: int

    @property
    def live(self) -> int:
        """All it holds on the live replica."""
        return self.part + self.reserve


def rejoin_room(need: int, rest: int, rejoin: str) -> int:
    """What the rejoin of a session needing ``need`` positions takes on the live replica beside its part, booked
    ahead: a replay's whole session; a move nothing (it hands the ``rest`` share over from the whole replica)."""
    if rejoin in ("shadow", "replay"):
        return need
    return 0


def split_booking(need: int, part: Span, stage: Span, rejoin: str, outlives: bool) -> SplitBooking:
    """The booking of a session split at ``part[1]`` of ``stage``: each part its share; the rejoin's room on the
    live replica when the session ``outlives`` the loading."""
    rest = kv_charge(need, (part[1], stage[1]), stage)
    reserve = rejoin_room(need, rest, rejoin) if outlives else 0
    return SplitBooking(kv_charge(need, part, stage), reserve, rest)


def loading_left_s(held: int, stage_layers: int, layers_per_s: float | None) -> float | None:
    """Seconds until a live replica holding ``held`` of its stage's ``stage_layers`` layers is whole, at the rate
    its layers have been arriving; None while there is no rate yet."""
    if layers_per_s is None or layers_per_s <= 0:
        return None
    return max(0, stage_layers - held) / layers_per_s


def outlives_loading(steps_left: int, step_s: float | None, load_left_s: float | None) -> bool:
    """Whether a session with ``steps_left`` steps of ``step_s`` each will still run when the live replica is whole
    (in ``load_left_s``); True while either estimate is missing (the safe side: its rejoin's room is booked)."""
    if step_s is None or load_left_s is None:
        return True
    return steps_left * step_s * OUTLIVE_MARGIN > load_left_s


def admission_rate(f: float, room: float, whole_s: float, split_s: float) -> float:
    """Sessions per second a stage can admit while its old replica's KV cache (``room`` sessions) is full and a live
    replica holds the share ``f`` of the layers (with as much room; 0 while it serves nothing, 1 once whole): a
    split session books ``1 - f`` of a session on the old replica and ``f`` on the live one for ``split_s`` seconds;
    new sessions split while both have room, and the old replica's room the splits leave takes whole sessions of
    ``whole_s``. Each replica's room frees at its room over its sessions' time (the fluid bound, before the FIFO
    line's gaps: a head that fits neither replica's leftover waits)."""
    if f <= 0:
        return room / whole_s
    if f >= 1:
        return 2 * room / whole_s
    splits = min(room / (1 - f), room / f)
    return splits / split_s + max(0.0, room - splits * (1 - f)) / whole_s


@dataclass(frozen=True, slots=True)
class RecutView:
    """What the re-cut of one split session is decided on, in KV positions: what it would move onto the live
    replica (``gain``), the live and the whole replica's free room, and what the head of the entry's line needs on
    each if it splits there now (``head_part``, ``head_rest``; 0 when nobody waits)."""

    gain: int
    gain_share: float
    steps_left: int
    live_room: int
    whole_room: int
    head_part: int
    head_rest: int
    waiting: int


def recut_pays(v: RecutView, min_share: float = RECUT_MIN_SHARE, min_steps: int = RECUT_MIN_STEPS) -> bool:
    """Whether to re-cut now: sessions wait, the whole replica lacks room for the head's rest while the live replica
    has room for this gain and the head's part besides (the re-cut turns live room nobody can use into whole-replica
    room the head needs), the gain is worth a move, and the session runs long enough to use it."""
    return (v.waiting > 0 and v.whole_room < v.head_rest and v.live_room - v.gain >= v.head_part
            and v.gain_share >= min_share and v.steps_left >= min_steps and v.gain > 0)
