"""Carrying out one planned start (``POST /v1/starts``): the scheduler's plan arrives whole (``StartOrder``), this
host decides only what its own state decides (is the stage cached here, is its file here), starts the replicas
and says what it did (``StartReport``: the path taken and, when it is not the plan's mode, why).

The rule, in order:

1. a function without the parameter cache (``cache`` false): every replica loads on its own (``cold``);
2. a zygote of the stage is cached here: fork from it (``fork``; a fallback when the plan fetched);
3. a plan that fetches (peer, multicast, live, cold, paraserve) of a registry stage not yet here: the replica
   starts while the bytes arrive, from the peers in order, then the registry (``keysmanager.live``), or its part
   first (``keysmanager.parts``, ParaServe); the path is the plan's mode, ``cold`` when no peer was given;
4. otherwise cache first (QUART §6.1: one parameter load, then every replica forks): ``cold`` when this start
   loaded the zygote, ``fork`` when one finished loading meanwhile.

The replicas are answered while still starting: the gateway's probe is the one that routes to them.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from keysmanager.types import StageSpec, StartOrder, StartPath, StartReport

if TYPE_CHECKING:
    from keysmanager.manager import KeysManager

FETCHING = ("peer", "multicast", "live", "cold", "paraserve")  # plans that bring the stage's bytes to this host


async def carry_out(km: KeysManager, spec: StageSpec, order: StartOrder) -> StartReport:
    """Start ``order.count`` replicas of ``spec`` as ``order`` says; one call, one answer."""
    planned, mode, count = order.mode, km.config.fork_mode, order.count
    requested_at = time.monotonic()
    if not order.cache:  # com.quart.keysmanager: off — replicas survive a KeysManager restart, nothing is cached
        started = await km.start_replicas(spec, count, mode, survive=True, wait=False, cache=False, cold=True)
        return _report(km, planned, "cold", started,
                       "" if planned == "cold" else "the function runs without the parameter cache")
    z = km.cached(spec.function)
    if z is not None:
        started = await km.started(await km.fork(z, spec, count, mode, True, requested_at=requested_at), False)
        return _report(km, planned, "fork", started,
                       "" if planned in ("fork", "gpu") else "the stage was cached here when the start arrived")
    why_not_live = ""
    if planned in FETCHING:
        started = await km.start_live(spec, count, False, order.peers, order.layers, requested_at)
        if started is not None:
            path: StartPath = "cold" if planned == "cold" or not order.peers else planned  # type: ignore[assignment]
            return _report(km, planned, path, await km.started(started, False),
                           "no peer address was given: fetching from the registry" if path != planned else "")
        why_not_live = "the stage's file was here already (or has no per-layer hashes): "
    before = km.zygotes.get(spec.function)
    z = await km.ensure_cached(spec, peers=order.peers)
    if z.ready is not None and not z.ready.done():
        await asyncio.shield(z.ready)  # being loaded by another start right now: wait, then fork
    loaded = z is not before  # this start paid for the parameter load
    started = await km.started(await km.fork(z, spec, count, mode, True, requested_at=requested_at), False)
    path = "cold" if loaded else "fork"
    if path == planned or (path == "fork" and planned == "gpu"):
        return _report(km, planned, path, started, "")
    why = (why_not_live + "loaded a zygote and forked" if loaded
           else "a zygote of the stage finished loading here meanwhile")
    if planned in ("fork", "gpu") and loaded:
        why = "no zygote of the stage was cached here any more: loaded one and forked"
    return _report(km, planned, path, started, why)


def _report(km: KeysManager, planned: str, path: StartPath, started: list, fallback: str) -> StartReport:
    # no memory readings here: they are slow to take from a process that is still starting
    return StartReport(planned, path, [km.replica_info(r, memory=False) for r in started], fallback)
