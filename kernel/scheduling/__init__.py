"""Replica placement (QUART §6.2). Pure placers shared by the embedded gateway and the simulator.

    placer = make_placer("cache-aware")            # or "first-fit" (cache-blind baseline)
    result = placer.place(hosts, [ReplicaRequest("m-stage-2", 2, param_bytes, key=True)], key_history)
    for p in result.placements: ...                 # p.host, p.source ("fork" | "peer" | "cold")
"""

from __future__ import annotations

from dataclasses import replace

from quart_kernel.scheduling.config import SchedulerConfig
from quart_kernel.scheduling.hosts import host_view_from_report
from quart_kernel.scheduling.paraserve import FetchHost, ParaServeCosts, ParaServePlan, plan_parallelism
from quart_kernel.scheduling.placers import CacheAwarePlacer, FirstFitPlacer, contention
from quart_kernel.scheduling.starts import MECHANISMS, StartPlan, plan_starts
from quart_kernel.scheduling.types import HostView, Placement, Placer, ReplicaRequest, ScheduleResult

PLACERS = ("cache-aware", "first-fit")


def make_placer(name: str, config: SchedulerConfig | None = None, **settings: object) -> Placer:
    """A placer by name: ``cache-aware`` (QUART) or ``first-fit`` (cache-blind baseline).

    `settings` override fields of `config` (default: :class:`SchedulerConfig` defaults, then the
    ``QUART_SCHED_*`` environment).
    """
    if name == "first-fit":
        return FirstFitPlacer()
    if name == "cache-aware":
        if config is None:
            return CacheAwarePlacer(SchedulerConfig.from_env(**settings))
        return CacheAwarePlacer(replace(config, **settings) if settings else config)
    raise ValueError(f"unknown placer {name!r}; choose one of {', '.join(PLACERS)}")


__all__ = [
    "PLACERS",
    "MECHANISMS",
    "CacheAwarePlacer",
    "FetchHost",
    "FirstFitPlacer",
    "HostView",
    "ParaServeCosts",
    "ParaServePlan",
    "Placement",
    "Placer",
    "ReplicaRequest",
    "ScheduleResult",
    "SchedulerConfig",
    "StartPlan",
    "contention",
    "host_view_from_report",
    "make_placer",
    "plan_parallelism",
    "plan_starts",
]
