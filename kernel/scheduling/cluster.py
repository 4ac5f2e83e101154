"""A mutable working copy of the hosts while one batch is placed (slots, memory, caches fill up)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from quart_kernel.scheduling.types import HostView, Placement, ReplicaRequest, Source


@dataclass
class HostState:
    """One host during placement: what is left after the replicas placed so far."""

    name: str
    gpu_free: int
    memory_limit: int
    memory_used: int
    cached: set[str]
    running: dict[str, int]
    order: int  # position in the caller's host list (first-fit order)
    held_elsewhere: frozenset[str] = frozenset()  # stages some host held when the batch began (a peer to fetch from)

    @classmethod
    def of(cls, view: HostView, order: int, held_elsewhere: frozenset[str] = frozenset()) -> HostState:
        return cls(
            name=view.name,
            gpu_free=view.gpu_free,
            memory_limit=view.memory_limit,
            memory_used=view.memory_used,
            cached=set(view.cached),
            running={k: int(v) for k, v in view.running.items()},
            order=order,
            held_elsewhere=held_elsewhere,
        )

    @classmethod
    def of_copy(cls, other: HostState) -> HostState:
        return cls(
            other.name, other.gpu_free, other.memory_limit, other.memory_used,
            set(other.cached), dict(other.running), other.order, other.held_elsewhere,
        )

    def fits(self, request: ReplicaRequest) -> bool:
        """A free slot, and the parameters fit in the host's memory at all (cached ones already do)."""
        if self.gpu_free <= 0:
            return False
        return request.function in self.cached or request.param_bytes <= self.memory_limit

    def needs_eviction(self, request: ReplicaRequest, memory_fill: float, cold_copies: float = 1.0) -> bool:
        """A cold start here (adding `cold_copies` × the parameters) would push memory past the limit."""
        if request.function in self.cached:
            return False
        return self.memory_used + cold_copies * request.param_bytes > memory_fill * self.memory_limit

    def source_for(self, function: str) -> Source:
        """fork (cached here) < peer (another host holds it: fetch over the network) < cold (the registry)."""
        if function in self.cached:
            return "fork"
        return "peer" if function in self.held_elsewhere else "cold"

    def take(self, request: ReplicaRequest, key: bool, cold_copies: float = 1.0) -> Placement:
        """Place one replica here; a cold start leaves a zygote (the KeysManager caches what it loads)."""
        source = self.source_for(request.function)
        self.gpu_free -= 1
        if source != "fork":
            self.cached.add(request.function)
            self.memory_used += int(cold_copies * request.param_bytes)
        self.running[request.function] = self.running.get(request.function, 0) + 1
        return Placement(function=request.function, host=self.name, source=source, key=key)


@dataclass
class Batch:
    """What one `place` call accumulates: placements and what did not fit."""

    placements: list[Placement] = field(default_factory=list)
    missing: dict[str, int] = field(default_factory=dict)

    def unplaced(self, requests: Iterable[ReplicaRequest]) -> tuple[ReplicaRequest, ...]:
        by_function = {r.function: r for r in requests}
        return tuple(
            ReplicaRequest(f, n, by_function[f].param_bytes, by_function[f].key)
            for f, n in self.missing.items()
            if n > 0
        )


def merge_requests(requests: Iterable[ReplicaRequest]) -> list[ReplicaRequest]:
    """One request per function (counts added, first order kept); non-positive counts dropped."""
    merged: dict[str, ReplicaRequest] = {}
    for r in requests:
        if r.count <= 0:
            continue
        if r.function in merged:
            m = merged[r.function]
            merged[r.function] = ReplicaRequest(
                r.function, m.count + r.count, max(m.param_bytes, r.param_bytes), m.key or r.key
            )
        else:
            merged[r.function] = r
    return list(merged.values())


def fair_trim(requests: list[ReplicaRequest], free_slots: int) -> tuple[list[ReplicaRequest], dict[str, int]]:
    """When the asks exceed the free GPU slots: max-min fair shares of the slots (each function gets an equal share,
    capped at its ask; the rest of the slots shared again; a remainder one each in request order), so that no
    function is starved by the ones placed before it (a pipeline runs at its slowest stage's rate). Returns the
    trimmed requests and what was cut per function (the caller reports it unplaced). Unchanged when all fit."""
    asked = sum(r.count for r in requests)
    if asked <= free_slots:
        return list(requests), {}
    share = {r.function: 0 for r in requests}
    left, open_ = max(0, free_slots), [r for r in requests]
    while left > 0 and open_:
        each = left // len(open_)
        if each == 0:  # fewer slots than open asks: one each, in request order
            for r in open_[:left]:
                share[r.function] += 1
            break
        for r in open_:
            give = min(each, r.count - share[r.function])
            share[r.function] += give
            left -= give
        open_ = [r for r in open_ if share[r.function] < r.count]
    trimmed = [ReplicaRequest(r.function, share[r.function], r.param_bytes, r.key) for r in requests
               if share[r.function] > 0]
    cut = {r.function: r.count - share[r.function] for r in requests if r.count > share[r.function]}
    return trimmed, cut
