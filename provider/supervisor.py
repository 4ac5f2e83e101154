"""KeysManagers supervised (issue 14, item 1): one that exits is started again, with back-off.

A killed KeysManager used to mean a permanent outage: nothing restarted it, so its host stayed down.
:func:`supervise` watches each agent process the composition root (:class:`.system.EmbeddedSystem`)
started; when one exits it starts a successor on the same socket and state folder after a delay from
:class:`Backoff` (0.5 s, doubling to 30 s; reset after a minute of running). The successor cleans what
its predecessor left (``keysmanager.recovery.recover``: zygotes and replicas killed, shared-memory
segments removed); the gateway's host health sees the host down within ``host_down_after_s`` (its
replicas dead to routing and replaced on other hosts) and back once the successor answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("quart.supervisor")


@dataclass(slots=True)
class Backoff:
    """Delays between restarts of one process. Pure: time is passed in."""

    initial_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0  # a process that ran this long starts over from ``initial_s``
    failures: int = 0
    started_at: float = 0.0
    restart_at: float | None = None  # when the pending restart is due; None = none pending

    def exited(self, now: float) -> float:
        """The process exited at ``now``: schedule a restart; returns its delay."""
        if now - self.started_at >= self.reset_after_s:
            self.failures = 0
        delay = min(self.max_s, self.initial_s * 2 ** self.failures)
        self.failures += 1
        self.restart_at = now + delay
        return delay

    def due(self, now: float) -> bool:
        return self.restart_at is not None and now >= self.restart_at

    def started(self, now: float) -> None:
        self.started_at, self.restart_at = now, None


async def supervise(agents: Sequence[Any], restart: Callable[[Any], None], interval_s: float = 0.1,
                    clock: Callable[[], float] = time.monotonic, exited: Callable[[Any], None] | None = None) -> None:
    """Until cancelled: each ``agent`` (``.name``, ``.process`` a ``Popen``, ``.backoff`` a :class:`Backoff`)
    whose process exited is told to ``exited(agent)`` at once (its host's replicas are dead) and restarted
    by ``restart(agent)`` when its back-off delay has passed."""
    while True:
        now = clock()
        for agent in agents:
            if agent.process.poll() is None:
                continue
            if agent.backoff.restart_at is None:
                delay = agent.backoff.exited(now)
                log.warning("KeysManager %s exited with %s; restarting in %.1f s", agent.name,
                            agent.process.returncode, delay)
                if exited is not None:
                    try:
                        exited(agent)
                    except Exception as exc:  # noqa: BLE001 - telling the gateway must not stop supervision
                        log.error("reporting the exit of KeysManager %s failed: %s", agent.name, exc)
            elif agent.backoff.due(now):
                try:
                    restart(agent)
                    agent.backoff.started(clock())
                    log.warning("KeysManager %s restarted (pid %d)", agent.name, agent.process.pid)
                except Exception as exc:  # noqa: BLE001 - a failed start is retried after the next delay
                    log.error("restarting KeysManager %s failed: %s", agent.name, exc)
                    agent.backoff.exited(clock())
        await asyncio.sleep(interval_s)
