"""Where the pipeline router's stage replicas come from: the :class:`ReplicaSource` interface, and
:class:`StaticReplicas`, a list the owner edits (tests; function-level dispatch to a real OpenFaaS gateway).

The embedded gateway's live replica sets are the other source (``gateway_plugin.plugin.GatewayView``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway_plugin import layers
from quart_kernel.admission import ServiceTimes


class ReplicaSource(Protocol):
    """Where a stage function's replicas are and how their slots are counted (a stable interface: the
    router, and engines built beside it, use only these).

    ``ready``: the replicas that may take a call (objects with ``id``, ``url``, ``in_flight``);
    ``take`` / ``give_back``: one slot of a replica, around each call; ``wait``: a future resolved when
    a slot may have freed or a replica became ready (a release, by anyone; a new replica) — the caller
    bounds its wait; ``service_times``: the function's one service-time estimator (admission's p90);
    ``note_held``: the layers a replica says it holds (its answer's ``X-Quart-Layers-Held``)."""

    def ready(self, function: str) -> list[Any]: ...

    def concurrency(self, function: str) -> int: ...  # per replica; 0 = unlimited

    def take(self, function: str, replica: Any) -> None: ...

    def give_back(self, function: str, replica: Any) -> None: ...

    def wait(self, function: str) -> asyncio.Future[None]: ...

    def service_times(self, function: str) -> ServiceTimes: ...

    def note_held(self, function: str, replica: Any, held: layers.Range) -> None: ...  # its answer's Layers-Held


@dataclass(slots=True)
class StaticReplica:
    id: str
    url: str
    in_flight: int = 0
    layers: layers.Range | None = None  # its stage's layers, when it reports them (see gateway_plugin.layers)
    held: layers.Range | None = None  # the layers it can run now (None: all of its stage)
    part: layers.Range | None = None  # a ParaServe part: the layers it serves a group's sessions for


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


@dataclass(slots=True)
class StaticReplicas:
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

    def take(self, function: str, replica: StaticReplica) -> None:
        replica.in_flight += 1

    def give_back(self, function: str, replica: StaticReplica) -> None:
        replica.in_flight -= 1
        self.waiters.wake(function)

    def wait(self, function: str) -> asyncio.Future[None]:
        return self.waiters.wait(function)

    def changed(self) -> None:
        self.waiters.wake()

    def service_times(self, function: str) -> ServiceTimes:
        return self.services.setdefault(function, ServiceTimes())

    def note_held(self, function: str, replica: StaticReplica, held: layers.Range) -> None:
        replica.held = held
