"""A replica's step slots, running sessions first: a decode step waiting for a slot goes before a waiting prefill.

A stage replica serves at most its concurrency (``com.quart.concurrency``) of steps at once; the engine queues the
rest here. The order is the one LLM schedulers use (vLLM's, Sarathi's): the sessions already running — their
decode steps, a catch-up after a rejoin — are served before new sessions' prefills, so a burst of new sessions
lengthens time to first token (they wait) and not the time between the running sessions' tokens. Within each
class, first come first served.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class StepSlots:
    """``limit`` slots (0: unlimited); ``async with slots.hold(running=...)`` holds one for a step."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.busy = 0
        self._running: deque[asyncio.Future[None]] = deque()
        self._new: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._running) + len(self._new)

    @contextlib.asynccontextmanager
    async def hold(self, running: bool) -> AsyncIterator[None]:
        """One slot for one step; ``running``: the step of a session already under way (it goes first)."""
        if self.limit > 0 and (self.busy >= self.limit or self.waiting):
            queue = self._running if running else self._new
            future = asyncio.get_running_loop().create_future()
            queue.append(future)
            try:
                await future  # resolved by a release, which handed its slot over (busy unchanged)
            except BaseException:
                if future.done() and not future.cancelled():
                    self._release()  # handed a slot while being cancelled: pass it on
                else:
                    with contextlib.suppress(ValueError):  # a release may have popped it already
                        queue.remove(future)
                raise
        else:
            self.busy += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        for queue in (self._running, self._new):
            while queue:
                future = queue.popleft()
                if not future.done():
                    future.set_result(None)  # the slot passes to it
                    return
        self.busy -= 1
