"""Placing missing replicas (a part of :class:`quart_provider.reconciler.Reconciler`): ask the placer, pin what it
keeps, plan how each placement starts (the simulator's rule, :func:`quart_provider.scheduling.starts.plan_starts`),
order chain multicasts, then hand each placement to the starter (:mod:`.starting`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from quart_provider.keysmanager_host import multicast
from quart_provider.scheduling.starts import StartPlan, chains_of, peers_of, plan_starts
from quart_provider.scheduling.types import HostView, ReplicaRequest, ScheduleResult
from quart_provider.types import FunctionState

from keysmanager.aio import within

if TYPE_CHECKING:
    from quart_provider.config import GatewayConfig
    from quart_provider.host_health import HostHealth
    from quart_provider.hosts import Host
    from quart_provider.paraserve_start import ParaServeStarts
    from quart_provider.scheduling.metrics import SchedulerMetrics
    from quart_provider.scheduling.types import Placer

log = logging.getLogger("quart.gateway")


class Placing:
    """Mixin of the reconciler: where missing replicas go and how they start. Runs on the reconciler's loop."""

    config: GatewayConfig
    hosts: Mapping[str, Host]
    placer: Placer
    functions: Mapping[str, FunctionState]
    key_history: Mapping[str, int]
    scheduler_metrics: SchedulerMetrics
    pins: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
    health: HostHealth
    paraserve: ParaServeStarts
    _tasks: set[asyncio.Task]

    async def _place(self, requests: list[ReplicaRequest]) -> None:
        names = [n for n in self.hosts if self.health.is_up(n)]
        reports = await asyncio.gather(*(within(self.config.host_timeout_s, self.hosts[n].report()) for n in names),
                                       return_exceptions=True)
        views: list[HostView] = []
        for name, report in zip(names, reports, strict=True):
            if isinstance(report, BaseException):
                log.warning("host %s gave no report: %s", name, report)
                continue
            pending = sum(1 for t in self._tasks if t.get_name().startswith(f"start:{name}:"))
            views.append(replace(report, gpu_used=min(report.gpu_slots, report.gpu_used + pending)))
        self.scheduler_metrics.record_hosts(views)
        result = self.placer.place(views, requests, dict(self.key_history))
        self.scheduler_metrics.record_schedule(result)
        await self._pin_kept(result, views)
        asked_at = time.monotonic()
        for fn in self.functions.values():
            fn.unplaced = 0
        for req in result.unplaced:
            if req.function in self.functions:
                self.functions[req.function].unplaced += req.count
        layouts = await self.paraserve.cold_layouts(result.placements, views, self.functions, self._spec) \
            if self.config.paraserve else {}
        plans = self._start_plans(result, views, layouts)
        groups = self.paraserve.plan_groups(plans, layouts)
        chains = chains_of(plans)
        for function, chain in chains:
            if function in self.functions:
                await self._multicast(self.functions[function], chain)
        for i, (placement, plan) in enumerate(zip(result.placements, plans, strict=True)):
            fn = self.functions.get(placement.function)
            if fn is None or placement.host not in self.hosts:
                continue
            fn.pending_starts += 1
            self._spawn(self._start_placed(fn, placement, fn.generation, asked_at, plan,
                                           self._peer_addresses(peers_of(plan, chains)), groups.get(i)),
                        f"start:{placement.host}:{fn.name}")
            for helper in plan.helpers if i in groups else ():  # ParaServe: the group's borrowed hosts
                fn.pending_starts += 1
                self._spawn(self._start_part(fn, helper, fn.generation, groups[i]), f"start:{helper}:{fn.name}")

    def _start_plans(self, result: ScheduleResult, views: list[HostView], layouts: dict | None = None
                     ) -> list[StartPlan]:
        """How each placement starts (:func:`quart_provider.scheduling.starts.plan_starts`, the simulator's rule):
        the holders of each stage are the hosts that cache it; a host serving replicas sends their answers on
        its NIC, so chains avoid sending from it."""
        holders: dict[str, list[str]] = {}
        for view in views:
            for function in view.cached | view.held:  # a zygote or the verified file: a peer can fetch it
                holders.setdefault(function, []).append(view.name)
        serving = [v.name for v in views if any(v.running.values())]
        busy = {(a, b) for a in serving for b in (v.name for v in views) if a != b}
        enabled = {"peer", "multicast"} if self.config.peer_fetch else set()
        live = self.config.live_scaling
        if live or (live is None and self.config.network == "netns"):  # default: on where hosts have addresses
            enabled.add("live")
        ready = {name: len(fn.ready) for name, fn in self.functions.items()}
        if layouts:  # ParaServe: P per cold stage, helpers on spare hosts
            enabled.add("paraserve")
        parts, spare = self.paraserve.plan_inputs(result.placements, views, layouts or {})
        return plan_starts(result.placements, holders, enabled, ready, parts, busy, spare)

    def _peer_addresses(self, names: tuple[str, ...]) -> list[str]:
        """The KeysManager addresses other hosts fetch from (hosts without one, e.g. on Unix sockets, left out)."""
        found = (getattr(self.hosts.get(n), "peer_address", None) for n in names)
        return [a for a in found if a]

    async def _multicast(self, fn: FunctionState, names: tuple[str, ...]) -> None:
        """Several hosts need ``fn``'s parameters at once: order the chain (BlitzScale §5.1) before the starts,
        which then find the transfer under way. A failure is logged: each start still fetches on its own."""
        chain = [self.hosts.get(n) for n in names]
        if any(h is not None and not hasattr(h, "prefetch") for h in chain):
            return  # hosts without a KeysManager cache nothing
        try:
            await within(5.0, multicast(self._spec(fn), chain))
            log.info("%s: chain multicast %s", fn.name, " → ".join(names))
        except Exception as exc:
            log.warning("%s: chain multicast over %s failed: %s", fn.name, names, exc)

    async def _pin_kept(self, result: ScheduleResult, views: list[HostView]) -> None:
        """Make ``keep_cached`` binding (QUART §6): each host's KeysManager evicts those key-stage zygotes last
        and never to cache another stage; and tell each host which stages it alone holds (its eviction drops
        duplicates first: one copy per cluster is enough, the others fetch from it). Sent only when a host's
        sets change; a failure is logged, not fatal."""
        calls, names = [], []
        copies: dict[str, int] = {}
        for view in views:
            for function in view.cached:
                copies[function] = copies.get(function, 0) + 1
        for view in views:
            name = view.name
            kept = tuple(sorted(f for f, h in result.keep_cached if h == name))
            sole = tuple(sorted(f for f in view.cached if copies[f] == 1))
            pin = getattr(self.hosts[name], "pin", None)  # KeysManager hosts pin; process hosts have nothing to pin
            if pin is not None and self.pins.get(name, ((), ())) != (kept, sole):
                calls.append(within(5.0, pin(list(kept), list(sole))))  # a stuck host must not stall placing
                names.append((name, (kept, sole)))
        for (name, sent), outcome in zip(names, await asyncio.gather(*calls, return_exceptions=True), strict=True):
            if isinstance(outcome, BaseException):
                log.warning("pinning %s on host %s failed: %s", ", ".join(sent[0]) or "nothing", name, outcome)
            else:
                self.pins[name] = sent
