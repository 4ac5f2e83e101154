"""Reconciliation: make the replicas that run match the registry's desired state.

A loop (every ``reconcile_interval_s``, or at once on :meth:`Reconciler.kick`) polls every host (each
poll bounded by ``host_timeout_s``; a host silent for ``host_down_after_s`` is down: its replicas are
dropped as dead and replaced elsewhere, and whatever still runs there is stopped when it answers again),
drops dead replicas, replaces ones that never became ready, and converges each function by the pure
rules of :mod:`.replicaset`: asks the placer for the shortfall, drains and stops the surplus, and
retires the previous generation once a rolling update's replicas are ready. New replicas are started
where the placer says, probed until their health path answers, and counted in the scheduler metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Mapping
from dataclasses import replace
from typing import Any

import aiohttp
from quart_provider.config import GatewayConfig
from quart_provider.host_health import HostHealth
from quart_provider.hosts import Host, ReplicaSpec, ReplicaStatus
from quart_provider.keysmanager_host import multicast
from quart_provider.paraserve_start import Group, ParaServeStarts
from quart_provider.replicaset import choose_surplus, rollover_done, shortfall
from quart_provider.scheduling.metrics import SchedulerMetrics
from quart_provider.scheduling.starts import StartPlan, chains_of, peers_of, plan_starts
from quart_provider.scheduling.types import HostView, Placement, Placer, ReplicaRequest, ScheduleResult
from quart_provider.types import Endpoint, FunctionState
from quart_stage.spans import H_LAYERS_HELD, parse_span

from keysmanager.aio import wait_event, within
from keysmanager.registry import MODEL_URL_ENV

log = logging.getLogger("quart.gateway")


class Reconciler:
    """Drives ``hosts`` towards ``functions`` (the registry's live mapping). All methods run on one loop."""

    def __init__(self, config: GatewayConfig, hosts: Mapping[str, Host], placer: Placer,
                 functions: Mapping[str, FunctionState], key_history: Mapping[str, int],
                 scheduler_metrics: SchedulerMetrics) -> None:
        self.config = config
        self.hosts = hosts
        self.placer = placer
        self.functions = functions
        self.key_history = key_history
        self.scheduler_metrics = scheduler_metrics
        self.pins: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # host → (pinned, sole copies) sent
        self._placed: dict[str, tuple[float, str, bool]] = {}  # replica id → (asked at, planned source, key)
        self._param_bytes: dict[str, tuple[int, int]] = {}  # function → (generation, stage parameter bytes)
        self._kick = asyncio.Event()
        self._closing = False
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._probe_session: aiohttp.ClientSession | None = None
        self.health = HostHealth(config.host_down_after_s)
        self.paraserve = ParaServeStarts(config)  # cold stages in parts (issue 17; off unless config.paraserve)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._reconcile_forever(), name="gateway-reconcile")

    async def close(self) -> None:
        """Stop the loop, every replica started here, and the hosts."""
        self._closing = True
        self.kick()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        stops = [self._stop_now(e) for f in self.functions.values() for e in list(f.replicas.values())]
        await asyncio.gather(*stops, return_exceptions=True)
        await asyncio.gather(*(h.close() for h in self.hosts.values()), return_exceptions=True)
        if self._probe_session is not None:
            await self._probe_session.close()
            self._probe_session = None

    def kick(self) -> None:
        """Reconcile now rather than at the next tick."""
        self._kick.set()

    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s failed: %s", task.get_name(), task.exception())

    # ---------------------------------------------------------------- one pass

    async def _reconcile_forever(self) -> None:
        while not self._closing:  # close() also cancels; the flag stops the loop if a cancel is ever lost
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a host down must not stop the loop
                log.warning("reconcile failed: %s", exc)
            await wait_event(self._kick, self.config.reconcile_interval_s)
            self._kick.clear()

    async def reconcile(self) -> None:
        """One pass: poll hosts, drop dead replicas, start missing ones, stop surplus, roll updates."""
        names = list(self.hosts)
        polled_at = time.monotonic()
        results = await asyncio.gather(*(within(self.config.host_timeout_s, self.hosts[n].replicas()) for n in names),
                                       return_exceptions=True)
        seen: dict[str, ReplicaStatus] = {}
        polled_hosts: set[str] = set()
        now = time.monotonic()
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                if self.health.failed(name, now):
                    self._host_down(name, result)
                elif self.health.is_up(name):
                    log.warning("host %s did not answer: %s", name, result or type(result).__name__)
                continue
            if self.health.answered(name, now):
                self._host_back(name, result)
            polled_hosts.add(name)
            seen.update((r.id, r) for r in result)
        for fn in self.functions.values():
            changed = False
            for endpoint in list(fn.replicas.values()):
                status = seen.get(endpoint.id)
                if status is None or status.state == "dead":
                    # a replica whose start finished while the hosts were being polled is not in their answers
                    if endpoint.host in polled_hosts and endpoint.started_at < polled_at:
                        del fn.replicas[endpoint.id]
                        changed = True
                    continue
                if (status.layers, status.held) != (endpoint.layers, endpoint.held) and status.layers is not None:
                    was_whole = endpoint.whole
                    endpoint.layers, endpoint.held = status.layers, status.held
                    changed = changed or endpoint.whole != was_whole
                    if endpoint.whole and not was_whole and endpoint.state == "ready":
                        self._replica_ready(fn, endpoint)
                if endpoint.state in ("starting", "ready") and status.state != endpoint.state:
                    if endpoint.probed and endpoint.state == "ready" and status.state == "starting":
                        continue  # our probe got the health answer first; the host's report lags behind
                    endpoint.state = status.state
                    changed = True
                    if endpoint.state == "ready":
                        self._replica_ready(fn, endpoint)
                if (endpoint.state == "starting" or not endpoint.whole) and now - endpoint.started_at > \
                        self.config.start_timeout_s:  # a live replica whose transfer stalls is replaced too
                    log.warning("replica %s of %s not ready after %.0f s: replacing it", endpoint.id, fn.name,
                                self.config.start_timeout_s)
                    self.retire(fn, endpoint)
                    changed = True
            if changed:
                fn.refresh_ready()
        await self._converge(now)

    def _host_down(self, name: str, why: BaseException) -> None:
        """``name`` stopped answering: its replicas are dead to routing (requests in flight on them fail over
        by the dead-peer sockets, see ``quart_provider.dead_peer``), starts and stops on it are abandoned,
        and the next pass places the missing replicas on the hosts that answer."""
        lost: set[str] = set()
        for fn in self.functions.values():
            gone = [e for e in fn.replicas.values() if e.host == name]
            for endpoint in gone:
                endpoint.state = "dead"
                del fn.replicas[endpoint.id]
                lost.add(endpoint.id)
            if gone:
                fn.refresh_ready()
        names = {f"stop:{rid}" for rid in lost} | {f"probe:{rid}" for rid in lost}
        for task in list(self._tasks):
            if task.get_name().startswith(f"start:{name}:") or task.get_name() in names:
                task.cancel()
        log.warning("host %s has not answered for %.1f s (%s): down; %d replica(s) marked dead", name,
                    self.health.silent_for(name, time.monotonic()), why or type(why).__name__, len(lost))
        self.kick()

    def host_lost(self, name: str, why: BaseException) -> None:
        """The host's agent is known gone (its process exited): down now, without waiting ``host_down_after_s``
        of silence; it is back when it answers a poll again (the supervisor restarts it)."""
        if name in self.hosts and self.health.is_up(name):
            self.health.down.add(name)
            self._host_down(name, why)

    def _host_back(self, name: str, running: list[ReplicaStatus]) -> None:
        """``name`` answers again: what still runs there was replaced while it was down, so stop it."""
        tracked = {rid for fn in self.functions.values() for rid in fn.replicas}
        stale = [r for r in running if r.id not in tracked and r.state != "dead"]
        for status in stale:
            self._spawn(self._stop_now(Endpoint(status.id, status.function, name, status.url, status.state,
                                                status.source, 0, 0.0)), f"stop:{status.id}")
        log.warning("host %s answers again; stopping %d replica(s) replaced while it was down", name, len(stale))
        self.kick()

    async def _converge(self, now: float) -> None:
        requests: list[ReplicaRequest] = []
        for fn in self.functions.values():
            current = [e for e in fn.replicas.values()
                       if e.generation == fn.generation and e.state in ("starting", "ready")]
            missing = shortfall(fn.desired, len(current), fn.pending_starts)
            if missing and now >= fn.retry_at:
                requests.append(ReplicaRequest(fn.name, missing, param_bytes=self._stage_param_bytes(fn),
                                               key=fn.name in self.key_history))
            keep = self.paraserve.protected(fn)  # ParaServe groups leave only once consolidated
            for endpoint in choose_surplus([e for e in current if e.id not in keep], fn.desired - len(keep)):
                self.retire(fn, endpoint)
            ready_current = sum(1 for e in current if e.state == "ready")
            old = [e for e in fn.replicas.values() if e.generation != fn.generation and e.state != "draining"]
            if old and rollover_done(ready_current, fn.desired):
                for endpoint in old:
                    self.retire(fn, endpoint)
        live = {rid for fn in self.functions.values() for rid in fn.replicas}
        for rid in [r for r in self._placed if r not in live]:  # died before it was ready
            del self._placed[rid]
        if requests:
            await self._place(requests)

    def _stage_param_bytes(self, fn: FunctionState) -> int:
        """The stage's parameter bytes (its checkpoint in the manifest), what a host caches; 0 for a process."""
        known = self._param_bytes.get(fn.name)
        if known is not None and known[0] == fn.generation:
            return known[1]
        size = 0
        if fn.runnable.kind == "stage":
            from keysmanager.stage import UnknownStage, resolve_stage

            try:
                size = resolve_stage(fn.name, self._spec(fn).env).param_bytes
            except (UnknownStage, ValueError, OSError) as exc:
                log.warning("%s: parameter size unknown (%s); placing it as parameter-free", fn.name, exc)
        self._param_bytes[fn.name] = (fn.generation, size)
        return size

    def _spec(self, fn: FunctionState) -> ReplicaSpec:
        return fn.replica_spec(self.config.max_body_bytes)

    # ---------------------------------------------------------------- placing and starting

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

    async def _start_part(self, fn: FunctionState, host: str, generation: int, group: Group) -> None:
        """Start a ParaServe group's helper (no placement of its own: it leaves once the group is whole)."""
        before = set(fn.replicas)
        await self._start_replica(fn, host, generation, None, True, True, group.part_on(host))
        group.started([r for r, e in fn.replicas.items() if r not in before and e.host == host])

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
        if self.config.live_scaling:
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

    async def _start_placed(self, fn: FunctionState, placement: Placement, generation: int, asked_at: float,
                            plan: StartPlan, peers: list[str], group: Group | None = None) -> None:
        """Start one placed replica as ``plan`` says and remember when it was asked for (its ready time is
        measured from then). ``group``: a ParaServe sub-pipeline; this replica starts with its part."""
        before = set(fn.replicas)
        # Any start that fetches the stage asks for a live start: the replica's process starts while the bytes
        # arrive (the KeysManager takes the ordinary path where it cannot). Only a "live" plan routes to it
        # before it holds the whole stage; a ParaServe part (``group``) starts with its layers and is routed at once.
        fetching = (plan.mode in ("peer", "multicast", "live", "cold") and fn.runnable.kind == "stage"
                    and MODEL_URL_ENV in fn.deployment.env_vars)  # a registry stage: bytes to fetch
        await self._start_replica(fn, placement.host, generation, peers, fetching, plan.mode == "live" or bool(group),
                                  group.part_on(placement.host) if group is not None else None)
        if group is not None:
            group.started([r for r, e in fn.replicas.items() if r not in before and e.host == placement.host])
        for rid, endpoint in list(fn.replicas.items()):
            if rid not in before and endpoint.host == placement.host and rid not in self._placed:
                self._placed[rid] = (asked_at, placement.source, placement.key)
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
            statuses = await self.hosts[host].start(self._spec(fn), 1, **extra)
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
                                held=status.held, partial_ok=partial_ok)
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

    # ---------------------------------------------------------------- draining

    def retire(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """Route nothing more to ``endpoint``; stop it once its in-flight requests are done (or drain times out)."""
        if endpoint.state == "draining":
            return
        endpoint.state = "draining"
        fn.refresh_ready()
        self._spawn(self._drain_then_stop(fn, endpoint), f"stop:{endpoint.id}")

    async def _drain_then_stop(self, fn: FunctionState, endpoint: Endpoint) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while endpoint.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self._stop_now(endpoint)
        fn.replicas.pop(endpoint.id, None)

    async def _stop_now(self, endpoint: Endpoint) -> None:
        host = self.hosts.get(endpoint.host)
        if host is not None:
            try:
                await host.stop(endpoint.id)
            except Exception as exc:
                log.warning("stopping replica %s failed: %s", endpoint.id, exc)
        endpoint.state = "dead"
