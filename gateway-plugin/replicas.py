"""Replicas the owner lists: :class:`StaticReplicas`, a :class:`~gateway_plugin.ports.ReplicaSource` over a list
the owner edits (tests; benchmarks), :class:`StaticReplica` (a fixed URL; the OpenFaaS view's slots too) and
:class:`Waiters` (the futures ``ReplicaSource.wait`` hands out).

The platforms' replicas are the other source (``gateway_plugin.view.GatewayView`` over a
:class:`~gateway_plugin.ports.Platform`: the embedded gateway's live replica sets, the OpenFaaS view's slots).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway_plugin.ports import Range, Replica, ReplicaSource
from quart_kernel.admission import ServiceTimes

__all__ = ["ListedSlots", "ReplicaSource", "StaticReplica", "StaticReplicas", "Waiters"]


@dataclass(slots=True)
class StaticReplica:
    id: str
    url: str
    in_flight: int = 0
    layers: Range | None = None  # its stage's layers, when it reports them (see gateway_plugin.layers)
    held: Range | None = None  # the layers it can run now (None: all of its stage)
    part: Range | None = None  # a ParaServe part: the layers it serves a group's sessions for
    state: str = "ready"  # a fixed replica is ready while it is listed


class Waiters:
    """Futures waiting for a function's next release or replica change (what ``ReplicaSource.wait`` hands out)."""

    __slots__ = ("futures",)

    def __init__(self) -> None:
        self.futures: dict[str, list[asyncio.Future[None]]] = {}

    def wait(self, function: str) -> asyncio.Future[None]:
        future = asyncio.get_running_loop().create_future()
        waiting = self.futures.setdefault(function, [])
        if len(waiting) >= 16:  # futures their waiters gave up on (timed out, cancelled): drop them
            waiting[:] = [f for f in waiting if not f.done()]
        waiting.append(future)
        return future

    def wake(self, function: str | None = None) -> None:
        """Resolve the waiters of ``function`` (of every function when None)."""
        names = list(self.futures) if function is None else [function]
        for name in names:
            for future in self.futures.pop(name, ()):
                if not future.done():
                    future.set_result(None)


class ListedSlots:
    """The slots of replicas a plugin lists itself (a test's fixed URLs, an OpenFaaS gateway's slots): counted on
    the replica, each release waking the function's waiters; a service-time estimator per function; the layers a
    replica's answer says it holds kept on it; no proxy queue beside the router (``waiting`` 0)."""

    __slots__ = ()
    waiters: Waiters
    services: dict[str, ServiceTimes]

    def take(self, function: str, replica: Replica) -> None:
        replica.in_flight += 1

    def give_back(self, function: str, replica: Replica) -> None:
        replica.in_flight -= 1
        self.waiters.wake(function)

    def wait(self, function: str) -> asyncio.Future[None]:
        return self.waiters.wait(function)

    def waiting(self, function: str) -> int:
        return 0

    def service_times(self, function: str) -> ServiceTimes:
        return self.services.setdefault(function, ServiceTimes())

    def note_held(self, function: str, replica: Replica, held: Range) -> None:
        replica.held = held


@dataclass(slots=True)
class StaticReplicas(ListedSlots):
    """A replica list per function that the owner edits (tests; a fixed set of upstream URLs); call
    :meth:`changed` after editing it, so that a dispatcher waiting for a replica looks again."""

    replicas: dict[str, list[StaticReplica]] = field(default_factory=dict)
    slots: int = 1
    waiters: Waiters = field(default_factory=Waiters)
    services: dict[str, ServiceTimes] = field(default_factory=dict)

    def ready(self, function: str) -> list[StaticReplica]:
        return list(self.replicas.get(function, ()))

    def concurrency(self, function: str) -> int:
        return self.slots

    def changed(self) -> None:
        self.waiters.wake()

    def mark_unreachable(self, function: str, replica: Replica) -> None:
        """Nothing: the owner edits the list (the router's ``tried`` keeps the request off the replica)."""

    def scale_from_zero(self, functions: Sequence[str]) -> None:
        """Nothing: the owner lists the replicas."""
