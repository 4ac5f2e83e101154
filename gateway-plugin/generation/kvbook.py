"""KV-cache occupancy per stage replica, as the gateway books it, and where a new session may go. Pure (a release
calls ``on_release``: the entry's line for room, :mod:`.roomwait`, tries again).

A session reserves, on the replica it is pinned to at each stage, every position it may come to hold
(prompt + max_tokens) for its whole life, so a replica's cache can never be asked for more than it has:
a session that finds no replica with room at some stage waits at the entry, bounded, then gets a 429 +
Retry-After, never an out-of-memory in a stage. A replica's cap is what it last reported (``X-Quart-KV-Tokens:
used/max``), else the configured default.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from quart_kernel.picking import pick

KV_HEADER = "X-Quart-KV-Tokens"


@dataclass
class KVBook:
    default_cap: int
    reserved: dict[str, int] = field(default_factory=dict)  # replica id -> positions booked
    caps: dict[str, int] = field(default_factory=dict)  # replica id -> what the replica reported
    on_release: Callable[[], None] | None = None  # room may have freed (the entry's waiters try again)
    on_freed: Callable[[str], None] | None = None  # a replica's sessions freed positions (its drain looks again)

    def cap(self, replica_id: str) -> int:
        return self.caps.get(replica_id, self.default_cap)

    def booked(self, replica_id: str) -> int:
        """Positions the sessions pinned to a replica hold (the reconciler's view: it drains until 0)."""
        return self.reserved.get(replica_id, 0)

    def room(self, replica_id: str) -> int:
        return self.cap(replica_id) - self.reserved.get(replica_id, 0)

    def reserve(self, replica_id: str, tokens: int) -> None:
        self.reserved[replica_id] = self.reserved.get(replica_id, 0) + tokens

    def release(self, replica_id: str, tokens: int) -> None:
        left = self.reserved.get(replica_id, 0) - tokens
        if left > 0:
            self.reserved[replica_id] = left
        else:
            self.reserved.pop(replica_id, None)
        if self.on_freed is not None:
            self.on_freed(replica_id)
        if self.on_release is not None:
            self.on_release()

    def reserve_all(self, bookings: Iterable[tuple[Any, int]]) -> None:
        """Book each (replica, positions) pair."""
        for replica, tokens in bookings:
            self.reserve(replica.id, tokens)

    def release_all(self, bookings: Iterable[tuple[Any, int]]) -> None:
        """Release each (replica, positions) pair."""
        for replica, tokens in bookings:
            self.release(replica.id, tokens)

    def note(self, replica_id: str, header: str | None) -> None:
        """Learn a replica's cap from its ``X-Quart-KV-Tokens: used/max`` answer header."""
        if not header or "/" not in header:
            return
        try:
            cap = int(header.split("/", 1)[1])
        except ValueError:
            return
        if cap > 0 and cap != self.caps.get(replica_id):
            grew = cap > self.cap(replica_id)
            self.caps[replica_id] = cap
            if grew and self.on_release is not None:
                self.on_release()

    def choose(self, ready: Iterable[Any], need: int, excluded: Collection[str] = ()) -> Any | None:
        """The replica a session needing ``need`` positions goes to: among the ready ones with room, the
        provider's pick rule (least in flight), ties to the least booked; None when none has room."""
        fits = [r for r in ready if r.id not in excluded and self.room(r.id) >= need]
        fits.sort(key=lambda r: self.reserved.get(r.id, 0))
        return pick(fits, 0)

    def occupancy(self) -> dict[str, dict[str, int]]:
        """Booked and cap per replica that holds a booking (for the snapshot and tests)."""
        return {rid: {"tokens": n, "cap": self.cap(rid)} for rid, n in self.reserved.items()}
