"""asyncio waits with a deadline that never lose or invent a cancellation (shared by the KeysManager and the gateway).

On Python 3.11, ``asyncio.wait_for`` returns the result, swallowing the cancel, when the caller is cancelled
just as the awaited thing completes: a ``while True`` loop stopped by ``task.cancel()`` then runs on forever
(it hung the embedded gateway's shutdown; tests/unit/test_aio.py reproduces it). ``asyncio.timeout`` ends a wait
by cancelling its own task and relies on ``uncancel`` bookkeeping to tell that apart from a real cancel.

These helpers wait with ``asyncio.wait``, which cancels nothing of the caller's: a cancel of the caller
always propagates, and a timeout is a plain ``TimeoutError`` / ``False``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(seconds: float, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, or raise ``TimeoutError`` after ``seconds`` (the awaitable is then cancelled and
    waited for, like ``asyncio.wait_for``). Cancelling the caller cancels the awaitable and propagates."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, seconds))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})
        if task.cancelled():
            raise TimeoutError(f"not done within {seconds:g} s")
    return task.result()


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set (True) or ``seconds`` pass (False). Always yields to the loop once, so a
    loop whose body sets its own event still lets other tasks run."""
    if event.is_set():
        await asyncio.sleep(0)
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=max(0.0, seconds))
    finally:
        if not waiter.done():
            waiter.cancel()
    return bool(done)
