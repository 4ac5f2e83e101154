"""keysmanager.aio: bounded waits that never lose a cancel (Python 3.11's wait_for does) nor invent one."""

from __future__ import annotations

import asyncio
import time

import pytest

from keysmanager.aio import wait_event, within


async def _stops_when_cancelled(k: int) -> bool:
    """A ``while True`` loop waiting on an event, cancelled ``k`` loop iterations after the event is set: the
    window in which ``asyncio.wait_for`` returns the result and swallows the cancel (k = 0, 1, 2 on 3.11)."""
    event = asyncio.Event()

    async def loop() -> None:
        while True:
            await wait_event(event, 10.0)
            event.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    event.set()
    for _ in range(k):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    if not done:
        task.cancel()  # do not leave it running
        await asyncio.wait({task}, timeout=1.0)
    return bool(done) and task.cancelled()


@pytest.mark.parametrize("k", range(6))
def test_a_cancelled_loop_always_stops(k):
    assert asyncio.run(_stops_when_cancelled(k))


def test_wait_event_times_out_and_returns_when_set():
    async def go():
        event = asyncio.Event()
        started = time.monotonic()
        assert await wait_event(event, 0.05) is False
        assert time.monotonic() - started >= 0.04
        asyncio.get_running_loop().call_later(0.02, event.set)
        assert await wait_event(event, 5.0) is True
        assert await wait_event(event, -1.0) is True  # already set: true even with no time left
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()], "a waiter was left behind"

    asyncio.run(go())


def test_wait_event_yields_when_the_event_is_already_set():
    async def go():
        event, ran = asyncio.Event(), []

        async def other() -> None:
            ran.append(True)

        asyncio.get_running_loop().create_task(other())
        for _ in range(3):  # a loop whose body keeps its own event set must still let other tasks run
            event.set()
            await wait_event(event, 1.0)
        return ran

    assert asyncio.run(go()) == [True]


def test_within_result_timeout_and_caller_cancel():
    async def go():
        assert await within(1.0, asyncio.sleep(0, result=7)) == 7

        inner_cancelled = asyncio.Event()

        async def slow() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                inner_cancelled.set()
                raise

        with pytest.raises(TimeoutError):
            await within(0.02, slow())
        assert inner_cancelled.is_set(), "the timed-out awaitable was not cancelled"

        inner_cancelled.clear()
        caller = asyncio.create_task(within(10.0, slow()))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0)
        assert inner_cancelled.is_set(), "cancelling the caller did not cancel the awaitable"

        with pytest.raises(ZeroDivisionError):  # the awaitable's own error passes through
            await within(1.0, fail())

    async def fail() -> None:
        raise ZeroDivisionError

    asyncio.run(go())
