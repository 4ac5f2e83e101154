"""The eviction rule of the KeysManager: which cached stages (zygotes) to drop to make room. Pure.

Least recently used first; a stage that still has live replicas goes last (dropping its zygote frees little:
the replicas keep mapping the shared parameter pages, and it is the stage most likely to scale again).
A stage some other host of the cluster also holds (a *duplicate*) goes before a *sole copy* of the same
standing: one cached copy per cluster is enough for fast scaling, since a host without one fetches it from a
peer (BlitzScale §4); the gateway tells each host which of its stages are sole copies. A protected stage
(the one being cached right now) is never chosen. A *pinned* stage (a key stage's zygote
the scheduler keeps, ``ScheduleResult.keep_cached``) goes only after every unpinned one, and not at all
when the room is wanted for an opportunistic cache (``evict_pinned=False``: the zygote a cold start
leaves behind must not displace a key stage's). Dropping a zygote never kills a replica: replicas outlive
their zygote. The simulator calls the same function.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One cached stage as the eviction rule sees it."""

    function: str
    param_bytes: int  # host memory freed when its zygote is dropped (0 while replicas still map it)
    last_used: float  # any monotonic clock: larger = more recent
    live_replicas: int = 0
    pinned: bool = False  # the scheduler asked to keep it (a key stage's zygote)
    sole_copy: bool = False  # no other host of the cluster holds it (losing it means the registry)


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    """Which zygotes to drop, in order, and whether that makes enough room."""

    evict: tuple[str, ...]
    freed_bytes: int
    satisfied: bool  # memory_used - freed + incoming <= limit


def eviction_order(entries: Iterable[CacheEntry]) -> list[CacheEntry]:
    """All entries in the order they would be evicted: unpinned before pinned, duplicates before sole copies,
    then no live replicas first, then least recently used."""
    return sorted(entries, key=lambda e: (e.pinned, e.sole_copy, e.live_replicas > 0, e.last_used, e.function))


def plan_eviction(
    entries: Sequence[CacheEntry],
    memory_used: int,
    memory_limit: int,
    incoming_bytes: int = 0,
    protect: Iterable[str] = (),
    evict_pinned: bool = True,
) -> EvictionPlan:
    """Choose zygotes to drop so that ``memory_used + incoming_bytes <= memory_limit``.

    ``memory_used`` is what the host holds now (it includes the entries' bytes). Stops as soon as the
    bytes fit; if dropping every unprotected entry is not enough, returns them all with ``satisfied=False``.
    An entry that frees nothing (``param_bytes == 0``: replicas still map all its pages) is never chosen.
    Pinned entries come after all others; with ``evict_pinned=False`` they are never chosen.
    """
    if memory_used < 0 or memory_limit < 0 or incoming_bytes < 0:
        raise ValueError("memory figures must be non-negative")
    protected = set(protect)
    excess = memory_used + incoming_bytes - memory_limit
    chosen: list[str] = []
    freed = 0
    candidates = (e for e in entries
                  if e.function not in protected and e.param_bytes > 0 and (evict_pinned or not e.pinned))
    for entry in eviction_order(candidates):
        if freed >= excess:
            break
        chosen.append(entry.function)
        freed += entry.param_bytes
    return EvictionPlan(evict=tuple(chosen), freed_bytes=freed, satisfied=freed >= excess)
