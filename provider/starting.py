"""Carrying out start actions (:mod:`quart_kernel.convergence`): pin what the placer keeps, order chain multicasts, ask each
host for its replica as the start plan says (peers, live, a ParaServe part), probe it until it answers, and
count its ready time in the scheduler metrics once it serves its whole stage. The reconciler decides; the
:class:`Starter` acts and reports back through the function state (replicas, pending starts, back-off)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
from quart_kernel.convergence import Action as StartAction
from quart_kernel.convergence import Convergence
from quart_kernel.scheduling.paraserve_groups import Group, StageLayout
from quart_kernel.scheduling.starts import chains_of, peers_of
from quart_kernel.scheduling.types import HostView, ScheduleResult
from quart_provider.hosts import ReplicaSpec, replica_cpus
from quart_provider.keysmanager_host import multicast
from quart_provider.paraserve_start import ParaServeStarts
from quart_provider.types import Endpoint, FunctionState
from quart_stage.spans import H_LAYERS_HELD, parse_span

from keysmanager.aio import within
from keysmanager.registry import MODEL_URL_ENV

if TYPE_CHECKING:
    from quart_provider.config import GatewayConfig
    from quart_provider.hosts import Host
    from quart_provider.scheduler_metrics import SchedulerMetrics

log = logging.getLogger("quart.gateway")


class Starter:
    """Starts the replicas a convergence asks for, on the reconciler's loop (its tasks, its kick)."""

    def __init__(self, config: GatewayConfig, hosts: Mapping[str, Host], functions: Mapping[str, FunctionState],
                 scheduler_metrics: SchedulerMetrics, paraserve: ParaServeStarts,
                 spawn: Callable[[Awaitable[Any], str], None], kick: Callable[[], None],
                 stop: Callable[[Endpoint], Awaitable[None]]) -> None:
        self.config = config
        self.hosts = hosts
        self.functions = functions
        self.scheduler_metrics = scheduler_metrics
        self.paraserve = paraserve
        self._spawn, self.kick, self._stop_now = spawn, kick, stop
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
            fn.pending_starts += 1
            self._spawn(self._start_placed(fn, action, fn.generation, asked_at,
                                           self._peer_addresses(peers_of(start, chains)), groups.get(i)),
                        f"start:{start.host}:{fn.name}")
            for helper in start.helpers if i in groups else ():  # ParaServe: the group's borrowed hosts
                fn.pending_starts += 1
                self._spawn(self._start_part(fn, helper, fn.generation, groups[i]), f"start:{helper}:{fn.name}")

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
        await self._start_replica(fn, host, generation, None, True, True, group.part_on(host))
        group.started([r for r, e in fn.replicas.items() if r not in before and e.host == host])

    async def _start_placed(self, fn: FunctionState, action: StartAction, generation: int, asked_at: float,
                            peers: list[str], group: Group | None = None) -> None:
        """Start one placed replica as its plan says and remember when it was asked for (its ready time is
        measured from then). ``group``: a ParaServe sub-pipeline; this replica starts with its part."""
        plan = action.plan
        assert plan is not None
        before = set(fn.replicas)
        # Any start that fetches the stage asks for a live start: the replica's process starts while the bytes
        # arrive (the KeysManager takes the ordinary path where it cannot). Only a "live" plan routes to it
        # before it holds the whole stage; a ParaServe part (``group``) starts with its layers and is routed at once.
        fetching = (plan.mode in ("peer", "multicast", "live", "cold") and fn.runnable.kind == "stage"
                    and MODEL_URL_ENV in fn.deployment.env_vars)  # a registry stage: bytes to fetch
        await self._start_replica(fn, plan.host, generation, peers, fetching, plan.mode == "live" or bool(group),
                                  group.part_on(plan.host) if group is not None else None)
        if group is not None:
            group.started([r for r, e in fn.replicas.items() if r not in before and e.host == plan.host])
        for rid, endpoint in list(fn.replicas.items()):
            if rid not in before and endpoint.host == plan.host and rid not in self._placed:
                self._placed[rid] = (asked_at, action.placed, action.key)
                if endpoint.state == "ready" and endpoint.whole:
                    self._replica_ready(fn, endpoint)

    def _replica_ready(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """The replica-ready hook: count the scale-up (source, ready ms) in the scheduler metrics, once, when the
        replica serves its whole stage.

        A stage replica counts as a cache hit only if its host held the stage when it was placed *and* it was
        forked from a zygote that was already there (a KeysManagerHost reports a start that had to load the
        zygote as cold)."""
        if not endpoint.whole:
            return  # a live replica is ready when it holds every layer (the poll or the router's answers say)
        placed = self._placed.pop(endpoint.id, None)
        if placed is None:
            return
        asked_at, planned, key = placed
        source = "cold" if "cold" in (planned, endpoint.source) else endpoint.source
        endpoint.ready_ms = 1000 * (time.monotonic() - asked_at)
        self.scheduler_metrics.record_replica(fn.name, endpoint.host, source, endpoint.ready_ms, key=key)
        fn.start_time.note(time.monotonic() - asked_at)

    async def _start_replica(self, fn: FunctionState, host: str, generation: int, peers: list[str] | None = None,
                             live: bool = False, partial_ok: bool = True, layers: tuple[int, int] | None = None
                             ) -> None:
        try:
            extra: dict[str, Any] = {"peers": peers} if peers else {}
            if live:
                extra["live"] = True
            if layers is not None:  # a ParaServe part start (keysmanager.parts)
                extra["layers"] = layers
            spec = self._spec(fn)
            statuses = await self.hosts[host].start(spec, 1, **extra)
        except Exception as exc:
            fn.start_failures += 1
            backoff = min(30.0, 0.5 * 2 ** (fn.start_failures - 1))
            fn.retry_at = time.monotonic() + backoff
            fn.last_error = f"starting a replica on {host} failed: {exc}"
            log.warning("%s: %s (retry in %.1f s)", fn.name, fn.last_error, backoff)
            return
        finally:
            fn.pending_starts -= 1
        fn.start_failures, fn.last_error = 0, ""
        now = time.monotonic()
        for status in statuses:
            endpoint = Endpoint(status.id, fn.name, host, status.url, status.state if status.state != "dead"
                                else "starting", status.source, generation, now, layers=status.layers,
                                held=status.held, partial_ok=partial_ok, part=layers, cpus=replica_cpus(spec))
            if self.functions.get(fn.name) is not fn:  # removed meanwhile
                self._spawn(self._stop_now(endpoint), f"stop:{endpoint.id}")
                continue
            fn.replicas[endpoint.id] = endpoint
            if endpoint.state == "starting":
                self._spawn(self._probe_until_ready(fn, endpoint), f"probe:{endpoint.id}")
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
                            endpoint.state, endpoint.probed = "ready", True
                            self._replica_ready(fn, endpoint)  # once, when it holds its whole stage
                            log.debug("%s ready %.1f ms after start (layers held %s)", endpoint.id,
                                      1000 * (time.monotonic() - endpoint.started_at), endpoint.held)
                            fn.refresh_ready()
                            self.kick()  # a rolling update may now retire old replicas
                        if endpoint.whole or endpoint.partial_ok:
                            return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(delay)
            delay = min(0.1, delay * 1.5)
