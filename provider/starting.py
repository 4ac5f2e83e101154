"""Carrying out start actions (:mod:`quart_kernel.convergence`): pin what the placer keeps, order chain multicasts, hand
each host its start plan whole (:class:`keysmanager.types.StartOrder`: the plan's mode, its peers' addresses, a
ParaServe part; one host call, which says what it did and any fallback), probe the replica until it answers, and
count its ready time in the scheduler metrics once it serves its whole stage. The reconciler decides; the
:class:`Starter` acts and reports back through the function state (replicas, back-off); its starts in flight
are entries of the reconciler's in-flight table (:class:`quart_provider.inflight.InFlight`).

A replica becomes ready in one place, :meth:`Starter.ready`, whoever saw it first: the gateway's own probe of its
health path, or its host's report at the next poll."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import aiohttp
from quart_kernel.convergence import Action as StartAction
from quart_kernel.convergence import Convergence
from quart_kernel.scheduling.paraserve_groups import Group, StageLayout
from quart_kernel.scheduling.starts import chains_of, peers_of
from quart_kernel.scheduling.types import HostView, ScheduleResult
from quart_provider.hosts import ReplicaSpec, replica_cpus
from quart_provider.inflight import InFlight
from quart_provider.keysmanager_host import multicast
from quart_provider.paraserve_start import ParaServeStarts
from quart_provider.types import Endpoint, FunctionState
from quart_stage.spans import H_LAYERS_HELD, parse_span

from keysmanager.aio import within
from keysmanager.types import StartOrder

if TYPE_CHECKING:
    from quart_provider.config import GatewayConfig
    from quart_provider.hosts import Host
    from quart_provider.scheduler_metrics import SchedulerMetrics

log = logging.getLogger("quart.gateway")


class Starter:
    """Starts the replicas a convergence asks for, on the reconciler's loop (its tasks, its kick)."""

    def __init__(self, config: GatewayConfig, hosts: Mapping[str, Host], functions: Mapping[str, FunctionState],
                 scheduler_metrics: SchedulerMetrics, paraserve: ParaServeStarts, work: InFlight,
                 kick: Callable[[], None], stop: Callable[[Endpoint], Awaitable[None]]) -> None:
        self.config = config
        self.hosts = hosts
        self.functions = functions
        self.scheduler_metrics = scheduler_metrics
        self.paraserve = paraserve
        self.work, self.kick, self._stop_now = work, kick, stop
        self.pins: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # host → (pinned, sole copies) sent
        self._placed: dict[str, tuple[float, str, bool]] = {}  # replica id → (asked at, planned source, key)
        self._probe_session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._probe_session is not None:
            await self._probe_session.close()
            self._probe_session = None

    def _spec(self, fn: FunctionState) -> ReplicaSpec:
        return fn.replica_spec(self.config.max_body_bytes)

    def forget_gone(self) -> None:
        """Drop the ask times of replicas that died before they were ready."""
        live = {rid for fn in self.functions.values() for rid in fn.replicas}
        for rid in [r for r in self._placed if r not in live]:
            del self._placed[rid]

    # ---------------------------------------------------------------- a convergence's starts

    async def start_all(self, plan: Convergence, views: Sequence[HostView],
                        layouts: Mapping[str, StageLayout]) -> None:
        """Carry out ``plan``'s starts: pins first, then chain multicasts, then one task per start."""
        result = plan.schedule
        if result is None:
            return
        self.scheduler_metrics.record_schedule(result)
        await self._pin_kept(result, views)
        asked_at = time.monotonic()
        starts = plan.starts
        plans = [a.plan for a in starts if a.plan is not None]
        groups = self.paraserve.plan_groups(plans, layouts)
        chains = chains_of(plans)
        for function, chain in chains:
            if function in self.functions:
                await self._multicast(self.functions[function], chain)
        for i, action in enumerate(starts):
            start = action.plan
            fn = self.functions.get(action.function)
            if start is None or fn is None or start.host not in self.hosts:
                continue
            self.work.run(self._start_placed(fn, action, fn.generation, asked_at,
                                             self._peer_addresses(peers_of(start, chains)), groups.get(i)),
                          "start", start.host, fn.name)
            for helper in start.helpers if i in groups else ():  # ParaServe: the group's borrowed hosts
                self.work.run(self._start_part(fn, helper, fn.generation, groups[i]), "start", helper, fn.name)

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

    # ---------------------------------------------------------------- one start

    async def _start_part(self, fn: FunctionState, host: str, generation: int, group: Group) -> None:
        """Start a ParaServe group's helper (no placement of its own: it leaves once the group is whole)."""
        before = set(fn.replicas)
        order = StartOrder("paraserve", (), group.part_on(host), self._spec(fn).param_cache)
        await self._start_replica(fn, host, generation, order, True)
        group.started([r for r, e in fn.replicas.items() if r not in before and e.host == host])

    async def _start_placed(self, fn: FunctionState, action: StartAction, generation: int, asked_at: float,
                            peers: list[str], group: Group | None = None) -> None:
        """Start one placed replica as its plan says and remember when it was asked for (its ready time is
        measured from then). ``group``: a ParaServe sub-pipeline; this replica starts with its part."""
        plan = action.plan
        assert plan is not None
        before = set(fn.replicas)
        # The plan travels whole: the host forks, fetches (a fetching start's process starts while the bytes
        # arrive) or caches first as its own state allows, and says which (keysmanager.starts). Only a "live"
        # plan routes to the replica before it holds the whole stage; a ParaServe part (``group``) starts with its
        # layers and is routed at once.
        order = StartOrder(plan.mode, tuple(peers), group.part_on(plan.host) if group is not None else None,
                           self._spec(fn).param_cache)
        await self._start_replica(fn, plan.host, generation, order, plan.mode == "live" or bool(group))
        if group is not None:
            group.started([r for r, e in fn.replicas.items() if r not in before and e.host == plan.host])
        for rid, endpoint in list(fn.replicas.items()):
            if rid not in before and endpoint.host == plan.host and rid not in self._placed:
                self._placed[rid] = (asked_at, action.placed, action.key)
                if endpoint.state == "ready" and endpoint.whole:
                    self.count_ready(fn, endpoint)

    def ready(self, fn: FunctionState, endpoint: Endpoint, seen_by: str) -> None:
        """``endpoint`` answered healthy (``seen_by``: the gateway's probe, or its host's report): route to it, count
        it once it holds its whole stage, and let the reconciler act (a rolling update may retire old replicas).
        The one place a replica becomes ready."""
        if fn.replicas.get(endpoint.id) is not endpoint or endpoint.state not in ("starting", "ready"):
            return
        if endpoint.state != "ready":
            log.debug("%s ready %.1f ms after start (%s; layers held %s)", endpoint.id,
                      1000 * (time.monotonic() - endpoint.started_at), seen_by, endpoint.held)
        endpoint.state = "ready"
        self.count_ready(fn, endpoint)  # once, when it holds its whole stage
        fn.refresh_ready()
        self.kick()

    def count_ready(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """Count the scale-up (source, ready ms) in the scheduler metrics, once, when the replica serves its whole
        stage (a live replica is whole when it holds every layer: the poll or the router's answers say).

        A stage replica counts as a cache hit only if its host held the stage when it was placed *and* its host
        forked it from a zygote that was already there (the start's path, ``keysmanager.starts``): anything
        else counts as cold."""
        if not endpoint.whole:
            return
        placed = self._placed.pop(endpoint.id, None)
        if placed is None:
            return
        asked_at, planned, key = placed
        source = "fork" if endpoint.source == "fork" and planned != "cold" else "cold"
        endpoint.ready_ms = 1000 * (time.monotonic() - asked_at)
        self.scheduler_metrics.record_replica(fn.name, endpoint.host, source, endpoint.ready_ms, key=key)
        fn.start_time.note(time.monotonic() - asked_at)

    async def _start_replica(self, fn: FunctionState, host: str, generation: int, order: StartOrder,
                             partial_ok: bool = True) -> None:
        """One host call carries ``order`` out; its replicas are tracked (and probed) as it answers."""
        spec = self._spec(fn)
        try:
            started = await self.hosts[host].start(spec, order)
        except Exception as exc:
            fn.start_failures += 1
            backoff = min(30.0, 0.5 * 2 ** (fn.start_failures - 1))
            fn.retry_at = time.monotonic() + backoff
            fn.last_error = f"starting a replica on {host} failed: {exc}"
            log.warning("%s: %s (retry in %.1f s)", fn.name, fn.last_error, backoff)
            return
        fn.start_failures, fn.last_error = 0, ""
        if started.fallback:
            log.info("%s on %s: planned %s, started %s: %s", fn.name, host, order.mode, started.path,
                     started.fallback)
        now = time.monotonic()
        for status in started.replicas:
            endpoint = Endpoint(status.id, fn.name, host, status.url, status.state if status.state != "dead"
                                else "starting", started.path, generation, now, layers=status.layers,
                                held=status.held, partial_ok=partial_ok, part=order.layers, cpus=replica_cpus(spec))
            if self.functions.get(fn.name) is not fn:  # removed meanwhile
                self.work.run(self._stop_now(endpoint), "stop", host, fn.name, endpoint.id)
                continue
            fn.replicas[endpoint.id] = endpoint
            if endpoint.state == "starting":
                self.work.run(self._probe_until_ready(fn, endpoint), "probe", host, fn.name, endpoint.id)
        fn.refresh_ready()
        self.kick()

    # ---------------------------------------------------------------- probing

    def _prober(self) -> aiohttp.ClientSession:
        if self._probe_session is None or self._probe_session.closed:
            self._probe_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._probe_session

    async def _probe_until_ready(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """GET the starting replica's health path (as its host does) and route to it as soon as it answers 200.

        Without this, a replica becomes routable only at the next reconcile poll of its host
        (``reconcile_interval_s``), which was most of a fork's ask→ready time. The interval starts at
        ``ready_probe_s`` and grows ×1.5 up to 0.1 s; a connection waits in the listen backlog until the
        replica serves, so one probe often spans the whole start. A replica started while its stage arrives
        answers with the layers it holds (``X-Quart-Layers-Held``); one that is not routed before it holds them
        all is probed on until it does.
        """
        url = endpoint.url + fn.runnable.health_path
        delay = self.config.ready_probe_s
        deadline = endpoint.started_at + self.config.start_timeout_s
        while fn.replicas.get(endpoint.id) is endpoint and (
                endpoint.state == "starting" or (endpoint.state == "ready" and not endpoint.whole)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return  # the reconcile loop replaces it
            try:
                async with self._prober().get(url, timeout=aiohttp.ClientTimeout(total=min(2.0, remaining))) as res:
                    if res.status == 200:
                        held = parse_span(res.headers.get(H_LAYERS_HELD))
                        if held is not None and endpoint.layers is not None:
                            endpoint.held = held
                        if fn.replicas.get(endpoint.id) is endpoint and endpoint.state in ("starting", "ready"):
                            endpoint.probed = True
                            self.ready(fn, endpoint, "the gateway's probe")
                        if endpoint.whole or endpoint.partial_ok:
                            return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(delay)
            delay = min(0.1, delay * 1.5)
