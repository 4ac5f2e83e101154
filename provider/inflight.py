"""The reconciler's work under way, as a typed table: one entry per task (kind, host, function, replica, since).

The one record of starts in flight: a function's pending starts (convergence counts them as current), the slots
they will take on a host (its placer view), the quiet rule (no start on a host under way or ended since its poll
began), a host gone down (its starts and its replicas' stops and probes are abandoned), a stop already under way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("quart.gateway")

WorkKind = Literal["start", "stop", "probe", "resize"]


@dataclass(frozen=True, slots=True)
class Work:
    """One piece of work: a start of ``function`` on ``host``, or a stop / probe / resize of ``replica``."""

    kind: WorkKind
    host: str
    function: str
    replica: str = ""
    since: float = 0.0  # monotonic seconds when it was asked for

    def __str__(self) -> str:
        return f"{self.kind} {self.replica or self.function} on {self.host}"


class InFlight:
    """Tasks and what each is doing; an entry leaves when its task ends. All methods run on one loop."""

    def __init__(self, on_settled: Callable[[Work], None] = lambda work: None) -> None:
        self._work: dict[asyncio.Task, Work] = {}
        self._settled: dict[str, float] = {}  # host → when a start on it last ended (done, failed or abandoned)
        self._on_settled = on_settled

    def run(self, coro: Awaitable[object], kind: WorkKind, host: str, function: str, replica: str = "") -> Work:
        """Run ``coro`` as a task recorded as ``kind`` work until it ends."""
        work = Work(kind, host, function, replica, time.monotonic())
        task = asyncio.ensure_future(coro)
        task.set_name(str(work))
        self._work[task] = work
        task.add_done_callback(self._done)
        return work

    def _done(self, task: asyncio.Task) -> None:
        work = self._work.pop(task)
        if work.kind == "start":
            self._settled[work.host] = time.monotonic()
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s failed: %s", work, task.exception())
        self._on_settled(work)

    # ---------------------------------------------------------------- reading the table

    def under_way(self, kind: WorkKind | None = None) -> list[Work]:
        return [w for t, w in self._work.items() if not t.done() and (kind is None or w.kind == kind)]

    def starts(self) -> Counter[tuple[str, str]]:
        """(host, function) → starts asked of the host and not answered yet."""
        return Counter((w.host, w.function) for w in self.under_way("start"))

    def starts_of(self, function: str) -> int:
        """``function``'s starts under way (its pending starts)."""
        return sum(1 for w in self.under_way("start") if w.function == function)

    def starts_on(self, host: str) -> int:
        return sum(1 for w in self.under_way("start") if w.host == host)

    def stopping(self, replica: str) -> bool:
        return any(w.replica == replica for w in self.under_way("stop"))

    def start_settled_since(self, host: str, since: float) -> bool:
        """A start on ``host`` ended at or after ``since``."""
        return self._settled.get(host, float("-inf")) >= since

    # ---------------------------------------------------------------- ending work

    def abandon(self, host: str, replicas: set[str]) -> None:
        """``host`` is down: cancel its starts, and the stops and probes of ``replicas`` (its replicas)."""
        for task, work in list(self._work.items()):
            if (work.kind == "start" and work.host == host) or (work.kind in ("stop", "probe")
                                                                  and work.replica in replicas):
                task.cancel()

    async def close(self) -> None:
        """Cancel every task and wait for them to end."""
        tasks = list(self._work)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
