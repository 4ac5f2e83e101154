"""Inputs and outputs of replica placement: pure data shared by the live gateway and the simulator."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

# already resident / KeysManager fork / parameters from a peer host that holds them (BlitzScale) / cold load
Source = Literal["gpu", "fork", "peer", "cold"]


@dataclass(frozen=True, slots=True)
class HostView:
    """What the scheduler knows of one host (from its KeysManager's report)."""

    name: str
    gpu_slots: int  # replica slots (GPUs) on the host
    gpu_used: int  # slots taken by running replicas
    memory_limit: int  # bytes the host may use for cached parameters
    memory_used: int  # bytes in use now
    cached: frozenset[str] = field(default_factory=frozenset)  # stage functions with a zygote here
    # live replicas per stage function on this host (spread of key stages); not part of the hash
    running: Mapping[str, int] = field(default_factory=dict, hash=False)
    held: frozenset[str] = field(default_factory=frozenset)  # stage files here that peers can fetch (not forked)

    @property
    def gpu_free(self) -> int:
        return max(0, self.gpu_slots - self.gpu_used)


@dataclass(frozen=True, slots=True)
class ReplicaRequest:
    """Ask for `count` new replicas of one stage function."""

    function: str
    count: int
    param_bytes: int = 0
    key: bool = False  # is it a key stage (scaled up by the corrector)?


@dataclass(frozen=True, slots=True)
class Placement:
    """One new replica: where it goes and how it will start."""

    function: str
    host: str
    source: Source
    key: bool = False  # placed as a key stage


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    placements: tuple[Placement, ...]
    unplaced: tuple[ReplicaRequest, ...] = ()  # what did not fit anywhere
    keep_cached: tuple[tuple[str, str], ...] = ()  # (function, host): zygotes to keep for key stages
    contention: float = 0.0  # requested replicas / free GPU slots when the batch was placed
    dispersed: bool = False  # key stages were placed by KL dispersion (high contention)
    kl_history: tuple[float, ...] = ()  # Σ KL of key-stage spreads per gradient step (dispersion only)


class Placer(Protocol):
    """A placement rule. Pure: same inputs, same output; no I/O."""

    name: str

    def place(
        self,
        hosts: list[HostView],
        requests: list[ReplicaRequest],
        key_history: dict[str, int] | None = None,
    ) -> ScheduleResult: ...
