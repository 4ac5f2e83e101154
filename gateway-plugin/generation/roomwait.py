"""The entry's wait for KV room: new sessions that find every ready replica of a stage full wait in arrival order.

As an LLM server's waiting queue (vLLM's first-come-first-served scheduler): a session whose stage has ready
replicas but none with room for its positions joins that stage function's queue instead of a 429 at once. Only
the head tries to take room, so a later session never takes room an earlier waiter fits in (strict FIFO: a
head that does not fit holds the ones behind it). The head tries again when room frees (the KV book's release:
a session ended, its DELETE answered, a split rejoined) and every ``poll_s`` (room that appears without a
release: a replica that became ready, a live replica's layers). A session that would wait past
``QUART_GEN_ROOM_WAIT_S`` (or its client's ``X-Quart-Timeout-Ms``), or that finds ``QUART_GEN_ROOM_QUEUE``
sessions waiting already, gets the 429 + Retry-After of before, naming which; a waiter whose client went away
(its task cancelled, or ``gone()``) leaves the queue and the next one becomes the head. A failover (a running
session that lost its replica) goes to the front: it was admitted before every waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from quart_stage.errors import QuartError, unavailable

T = TypeVar("T")
CHECK_S = 0.25  # how often a waiter behind the head asks whether its client is still there


@dataclass
class RoomCounts:
    """What the queue did since the start (for the snapshot and the benches)."""

    waited: int = 0  # sessions that waited and got room
    full: int = 0  # refused at once: the queue held QUART_GEN_ROOM_QUEUE sessions
    late: int = 0  # refused after waiting their bound
    gone: int = 0  # left the queue: the client went away
    wait_s: deque[float] = field(default_factory=lambda: deque(maxlen=1024))  # each served waiter's wait (the last 1024)


class RoomQueue:
    """Sessions waiting for KV room at the entry, per stage function, first come first served."""

    def __init__(self, limit: int, retry_after_s: float, poll_s: float, clock: Callable[[], float]) -> None:
        self.limit, self.retry_after_s, self.poll_s, self.clock = limit, retry_after_s, poll_s, clock
        self._queues: dict[str, deque[asyncio.Event]] = {}
        self._need: dict[asyncio.Event, int] = {}  # each waiter's KV positions
        self.counts = RoomCounts()

    def waiting(self, function: str) -> int:
        """Sessions waiting for room at stage ``function`` now."""
        return len(self._queues.get(function, ()))

    def waiting_positions(self, function: str) -> int:
        """The KV positions the sessions waiting at stage ``function`` need (demand the autoscaler must see)."""
        return sum(self._need[waiter] for waiter in self._queues.get(function, ()))

    def head_positions(self, function: str) -> int:
        """The KV positions the first session waiting at stage ``function`` needs (0: nobody waits)."""
        queue = self._queues.get(function)
        return self._need.get(queue[0], 0) if queue else 0

    def snapshot(self) -> dict:
        """Sessions waiting per stage function now, and what the line did since the start."""
        c = self.counts
        return {"waiting": {fn: len(q) for fn, q in self._queues.items() if q},
                "waiting_positions": {fn: n for fn in self._queues if (n := self.waiting_positions(fn))},
                "waited": c.waited, "refused_late": c.late, "refused_full": c.full, "gone": c.gone}

    def freed(self) -> None:
        """Room may have freed somewhere: the head of every queue tries again."""
        for queue in self._queues.values():
            if queue:
                queue[0].set()

    async def placed(self, function: str, attempt: Callable[[], T | None], what: str, wait_s: float,
                     gone: Callable[[], bool] | None = None, first: bool = False, positions: int = 0) -> T:
        """``attempt()``'s placement (it books nothing; the caller books what it returns before it awaits anything)
        once it is this session's turn and it fits; 429 when the wait would pass ``wait_s`` or the queue is full,
        499 when ``gone()`` says the client went away. ``what`` names the room sought, for the 429's message;
        ``positions``: what the session needs, counted as the stage's waiting demand while it waits."""
        queue = self._queues.setdefault(function, deque())
        if not queue or first:
            placed = attempt()
            if placed is not None:
                return placed
        if wait_s <= 0:
            raise unavailable(429, f"no replica of {function!r} has room for {what} now (every one holds other "
                                   "sessions); retry later", self.retry_after_s)
        if len(queue) >= self.limit and not first:
            self.counts.full += 1
            raise unavailable(429, f"{len(queue)} sessions already wait for KV room at stage {function!r} "
                                   f"(QUART_GEN_ROOM_QUEUE={self.limit}); retry later", self.retry_after_s)
        me, start = asyncio.Event(), self.clock()
        if first:
            queue.appendleft(me)
        else:
            queue.append(me)
        self._need[me] = positions
        try:
            while True:
                if queue[0] is me and (placed := attempt()) is not None:
                    self.counts.waited += 1
                    self.counts.wait_s.append(self.clock() - start)
                    return placed
                left = start + wait_s - self.clock()
                if left <= 0:
                    self.counts.late += 1
                    raise unavailable(429, f"no replica of {function!r} had room for {what} within {round(wait_s, 2):g} s of "
                                           f"waiting in line ({len(queue) - 1} others waiting; QUART_GEN_ROOM_WAIT_S); "
                                           "retry later", self.retry_after_s)
                if gone is not None and gone():
                    self.counts.gone += 1
                    raise QuartError(499, "the client closed the request while it waited for KV room")
                me.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), min(left, self.poll_s if queue[0] is me else CHECK_S))
        finally:
            queue.remove(me)
            del self._need[me]
            if queue:
                queue[0].set()  # the next one's turn: it tries at once
            else:
                self._queues.pop(function, None)
