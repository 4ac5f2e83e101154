"""The one pick rule for a request's replica, used by the embedded gateway's proxy
(:class:`quart_provider.balancer.Balancer`), the pipeline router and the generation sessions' replica choice:
least in flight among the ready replicas with a free slot (``com.quart.concurrency`` 0 = unlimited, OpenFaaS's
``max_inflight`` meaning), replicas already tried for this request last. Pure: it reads what it is given and changes nothing."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol, TypeVar


class Slotted(Protocol):
    """What the pick rule reads of a replica (the provider's Endpoint, the router's StaticReplica)."""

    @property
    def id(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


R = TypeVar("R", bound=Slotted)


def pick(ready: Iterable[R], concurrency: int, tried: Collection[str] = ()) -> R | None:
    """The ready replica to send the next request to, or None when every one is at ``concurrency``.

    Least in flight first (the first listed on a tie); a replica in ``tried`` only when no untried one
    has a free slot (a retry goes elsewhere when it can). ``concurrency`` 0 = no per-replica limit."""
    free = [r for r in ready if not concurrency or r.in_flight < concurrency]
    fresh = [r for r in free if r.id not in tried] if tried else free
    return min(fresh or free, key=lambda r: r.in_flight, default=None)
