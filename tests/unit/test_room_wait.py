"""The entry's wait for KV room (gateway_plugin.generation.roomwait): first come first served, bounded, woken by
a release, left by a client that goes away."""

from __future__ import annotations

import asyncio
import time

import pytest
from gateway_plugin.generation.roomwait import RoomQueue
from quart_stage.errors import QuartError

SLOW_POLL = 30.0  # longer than any test: only a release (freed) wakes the head


class Room:
    """``free`` slots; a placement takes one (as the engine books what the queue hands it at once)."""

    def __init__(self, free: int = 0) -> None:
        self.free = free

    def attempt(self, name: str):
        if self.free <= 0:
            return None
        self.free -= 1
        return name


def queue(limit: int = 16, poll_s: float = SLOW_POLL) -> RoomQueue:
    return RoomQueue(limit, retry_after_s=2, poll_s=poll_s, clock=time.monotonic)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_waiters_get_freed_room_in_arrival_order_and_a_later_one_never_jumps_the_line() -> None:
    async def main():
        q, room, order = queue(), Room(), []

        async def one(name: str):
            order.append(await q.placed("fn", lambda: room.attempt(name), "80 positions", 10.0))

        tasks = []
        for name in "abcd":
            tasks.append(asyncio.create_task(one(name)))
            await _settle()
        assert q.waiting("fn") == 4 and order == []
        for k in range(4):
            room.free += 1
            q.freed()
            await _settle()
            assert order == list("abcd"[: k + 1])  # woken by the release, not a poll (SLOW_POLL), head first
            if k == 1:  # room frees while two wait: a newcomer joins the line behind them, it does not take it
                late = asyncio.create_task(one("e"))
                await _settle()
                assert q.waiting("fn") == 3
        room.free += 1
        q.freed()
        await asyncio.gather(*tasks, late)
        assert order == list("abcde") and q.waiting("fn") == 0
        assert q.counts.waited == 5 and len(q.counts.wait_s) == 5
    asyncio.run(main())


def test_an_empty_line_places_at_once_and_a_zero_wait_refuses_at_once() -> None:
    async def main():
        q, room = queue(), Room(1)
        assert await q.placed("fn", lambda: room.attempt("a"), "80 positions", 10.0) == "a"
        with pytest.raises(QuartError) as refused:
            await q.placed("fn", lambda: room.attempt("b"), "80 positions", 0.0)
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "2"
        assert "has room for 80 positions now" in refused.value.message and q.waiting("fn") == 0
    asyncio.run(main())


def test_past_its_bound_a_waiter_gets_429_with_retry_after_naming_the_wait() -> None:
    async def main():
        q, room = queue(poll_s=0.02), Room()
        start = time.monotonic()
        with pytest.raises(QuartError) as refused:
            await q.placed("fn", lambda: room.attempt("a"), "80 positions", 0.2)
        assert 0.2 <= time.monotonic() - start < 1.0
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "2"
        assert "within 0.2 s of waiting" in refused.value.message and "QUART_GEN_ROOM_WAIT_S" in refused.value.message
        assert q.waiting("fn") == 0 and q.counts.late == 1
    asyncio.run(main())


def test_a_full_line_refuses_at_once_naming_the_limit() -> None:
    async def main():
        q, room = queue(limit=2), Room()
        waiters = [asyncio.create_task(q.placed("fn", lambda: room.attempt("w"), "80 positions", 10.0))
                   for _ in range(2)]
        await _settle()
        with pytest.raises(QuartError) as refused:
            await q.placed("fn", lambda: room.attempt("x"), "80 positions", 10.0)
        assert refused.value.status == 429 and "Retry-After" in refused.value.headers
        assert "2 sessions already wait" in refused.value.message and "QUART_GEN_ROOM_QUEUE=2" in refused.value.message
        assert q.waiting("other") == 0  # a line per stage function
        assert q.snapshot() == {"waiting": {"fn": 2}, "waiting_positions": {}, "waited": 0, "refused_late": 0,
                                "refused_full": 1, "gone": 0}
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert q.waiting("fn") == 0
    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_line_and_the_next_one_takes_the_room() -> None:
    async def main():
        q, room, got = queue(), Room(), []

        async def one(name: str):
            got.append(await q.placed("fn", lambda: room.attempt(name), "80 positions", 10.0))

        first = asyncio.create_task(one("a"))
        await _settle()
        second = asyncio.create_task(one("b"))
        await _settle()
        room.free = 1  # room is there, but nobody was told: the head leaves, which hands the turn on
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await _settle()
        assert got == ["b"] and q.waiting("fn") == 0
        await second
    asyncio.run(main())


def test_a_waiter_whose_client_went_away_leaves_with_499() -> None:
    async def main():
        q, room, gone = queue(poll_s=0.02), Room(), {"b": False}
        head = asyncio.create_task(q.placed("fn", lambda: room.attempt("a"), "80 positions", 10.0))
        await _settle()
        behind = asyncio.create_task(q.placed("fn", lambda: room.attempt("b"), "80 positions", 10.0,
                                              gone=lambda: gone["b"]))
        await _settle()
        gone["b"] = True
        with pytest.raises(QuartError) as left:
            await asyncio.wait_for(behind, 2.0)  # checked every CHECK_S behind the head
        assert left.value.status == 499 and q.waiting("fn") == 1 and q.counts.gone == 1
        room.free = 1
        q.freed()
        assert await asyncio.wait_for(head, 2.0) == "a"
    asyncio.run(main())


def test_a_failover_goes_to_the_front_of_the_line() -> None:
    async def main():
        q, room, got = queue(), Room(), []

        async def one(name: str, first: bool = False):
            got.append(await q.placed("fn", lambda: room.attempt(name), "80 positions", 10.0, first=first))

        tasks = [asyncio.create_task(one("new"))]
        await _settle()
        tasks.append(asyncio.create_task(one("failover", first=True)))
        await _settle()
        room.free = 2
        q.freed()
        await asyncio.gather(*tasks)
        assert got == ["failover", "new"]
    asyncio.run(main())
