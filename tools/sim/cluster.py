"""The simulated cluster: hosts with GPU slots, host memory and a KeysManager parameter cache.

A host answers the placer with a `HostView` (the same type the live KeysManager report becomes),
reserves a GPU slot for a new replica, and keeps stage parameters cached in host memory ("zygotes")
when its KeysManager is on. Making room uses the KeysManager's own pure eviction rule
(`keysmanager.eviction.plan_eviction`), so cache behaviour matches the live daemon's.

A released replica may leave its parameters resident on its GPU for ``gpu_keep_s``: a scale-up of the
same stage on that host within that time reuses the slot at the "gpu" start cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quart_kernel.scheduling import HostView

from keysmanager.eviction import CacheEntry, plan_eviction


@dataclass(slots=True)
class Slot:
    """One GPU of a host."""

    index: int
    replica: object | None = None  # the replica holding it (starting, ready or draining)
    resident: str | None = None  # stage whose parameters stay on the GPU after its replica left
    resident_until: float = 0.0


@dataclass(slots=True)
class CachedStage:
    function: str
    param_bytes: int
    last_used: float


@dataclass
class Host:
    """One GPU server: slots, memory, KeysManager cache."""

    name: str
    gpus: int
    memory_limit: int
    keysmanager: bool = True
    eviction_threshold: float = 0.85
    slots: list[Slot] = field(default_factory=list)
    cache: dict[str, CachedStage] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)
    evictions: int = 0
    pinned: frozenset[str] = frozenset()  # the placer's keep_cached for this host (the live KeysManager's pins)

    def __post_init__(self) -> None:
        self.slots = [Slot(i) for i in range(self.gpus)]

    # ------------------------------------------------------------------ what the placer sees
    @property
    def gpu_used(self) -> int:
        return sum(1 for s in self.slots if s.replica is not None)

    @property
    def memory_used(self) -> int:
        return sum(c.param_bytes for c in self.cache.values())

    def view(self) -> HostView:
        return HostView(
            name=self.name,
            gpu_slots=self.gpus,
            gpu_used=self.gpu_used,
            memory_limit=self.memory_limit,
            memory_used=self.memory_used,
            cached=frozenset(self.cache) if self.keysmanager else frozenset(),
            running=dict(self.running),
        )

    # ------------------------------------------------------------------------------ slots
    def take_slot(self, function: str, now: float) -> tuple[Slot, bool]:
        """A free slot, preferring one where ``function``'s parameters are still resident.

        Returns (slot, resident hit). Raises if the host is full (the placer never asks then).
        """
        free = [s for s in self.slots if s.replica is None]
        if not free:
            raise RuntimeError(f"host {self.name} has no free GPU slot")
        for s in free:
            if s.resident == function and s.resident_until >= now:
                s.resident = None
                return s, True
        # Otherwise a slot without resident parameters first, then the stalest resident one.
        free.sort(key=lambda s: (s.resident is not None and s.resident_until >= now, s.resident_until))
        slot = free[0]
        slot.resident = None
        return slot, False

    def release_slot(self, slot: Slot, function: str, now: float, keep_s: float) -> None:
        slot.replica = None
        if keep_s > 0:
            slot.resident, slot.resident_until = function, now + keep_s
        self.running[function] = self.running.get(function, 0) - 1
        if self.running[function] <= 0:
            del self.running[function]

    def occupy(self, slot: Slot, replica: object, function: str) -> None:
        slot.replica = replica
        self.running[function] = self.running.get(function, 0) + 1

    # --------------------------------------------------------------------- KeysManager cache
    def is_cached(self, function: str) -> bool:
        return self.keysmanager and function in self.cache

    def touch(self, function: str, now: float) -> None:
        if function in self.cache:
            self.cache[function].last_used = now

    def invalidate(self, function: str) -> None:
        """A new spec of ``function`` (other than its CPUs): its zygote and GPU-resident parameters are dropped,
        as the live gateway's rolling update makes every KeysManager do."""
        self.cache.pop(function, None)
        for slot in self.slots:
            if slot.resident == function:
                slot.resident = None

    def cache_stage(self, function: str, param_bytes: int, now: float) -> bool:
        """Keep ``function``'s parameters as a zygote after a cold load; evict LRU zygotes if needed.

        Returns whether it is cached afterwards (False without a KeysManager or when it cannot fit).
        """
        if not self.keysmanager:
            return False
        if function in self.cache:
            self.touch(function, now)
            return True
        limit = int(self.eviction_threshold * self.memory_limit)
        entries = [CacheEntry(c.function, c.param_bytes, c.last_used, self.running.get(c.function, 0),
                              pinned=c.function in self.pinned)
                   for c in self.cache.values()]
        # as the live daemon's cache-after-cold: never drop a pinned (key-stage) zygote for it
        plan = plan_eviction(entries, self.memory_used, limit, param_bytes, protect=(function,), evict_pinned=False)
        if not plan.satisfied:
            return False
        for victim in plan.evict:
            del self.cache[victim]
            self.evictions += 1
        self.cache[function] = CachedStage(function, param_bytes, now)
        return True


def make_hosts(count: int, gpus: int, memory_bytes: int, keysmanager: bool, eviction_threshold: float) -> list[Host]:
    width = len(str(max(0, count - 1)))
    return [Host(f"gpu-{i:0{width}d}", gpus, memory_bytes, keysmanager, eviction_threshold) for i in range(count)]
