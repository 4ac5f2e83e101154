"""The core of the embedded gateway: function registry, replica sets, reconciliation, load balancing.

This is what the REST API (:mod:`.api`) and the gateway plugin (router, controller) build on:

- ``deploy / update / remove / scale / update_limits``: the control plane (desired state);
- a reconcile loop that polls every host, starts missing replicas where the placer says, stops
  surplus ones after draining them, and rolls replicas over to a new generation on update;
- ``acquire / release`` (or ``lease``): the least-loaded *ready* replica of a function, with its
  in-flight count kept exact, waiting (bounded) for one when none is ready or all are at their
  concurrency limit;
- ``add_invoke_hook``: the plugin's router takes ``/function/<name>`` for names that are not
  deployed functions (a pipeline, ``POST /function/<model>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import aiohttp
from quart_provider.config import GatewayConfig
from quart_provider.deployment import FunctionDeployment, RequestError, Resources
from quart_provider.hosts import Host, ReplicaSpec, ReplicaStatus
from quart_provider.images import INDEX_FILE, ImageIndex, Runnable, resolve
from quart_provider.metrics import GatewayMetrics
from quart_provider.replicaset import StartTimeEstimate, choose_surplus, shortfall
from quart_provider.scheduling.metrics import SchedulerCollector, SchedulerMetrics
from quart_provider.scheduling.types import HostView, Placement, Placer, ReplicaRequest, ScheduleResult

from keysmanager.aio import wait_event, within

log = logging.getLogger("quart.gateway")

InvokeHook = Callable[[Any, str, str], Awaitable[Any]]  # (aiohttp request, name, sub-path) → response | None


@dataclass(slots=True)
class Endpoint:
    """A replica the gateway routes to; ``in_flight`` counts requests it is serving now."""

    id: str
    function: str
    host: str
    url: str
    state: str  # starting | ready | draining | dead
    source: str
    generation: int
    started_at: float
    in_flight: int = 0
    served: int = 0
    probed: bool = False  # the gateway's own health probe saw it ready (ahead of the host's report)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "function": self.function, "host": self.host, "url": self.url, "state": self.state,
                "source": self.source, "generation": self.generation, "inFlight": self.in_flight,
                "served": self.served}


@dataclass(slots=True)
class FunctionState:
    """One deployed function: its spec, desired replicas, and the replicas it has."""

    deployment: FunctionDeployment
    runnable: Runnable
    desired: int
    created_at: datetime
    generation: int = 1
    replicas: dict[str, Endpoint] = field(default_factory=dict)
    ready: list[Endpoint] = field(default_factory=list)  # routing list: state == ready
    pending_starts: int = 0
    invocations: int = 0
    waiting: int = 0
    wakeups: list[asyncio.Future] = field(default_factory=list)
    unplaced: int = 0
    start_failures: int = 0  # consecutive failed replica starts (backoff)
    retry_at: float = 0.0  # monotonic time before which no new start is tried
    last_error: str = ""
    start_time: StartTimeEstimate = field(default_factory=StartTimeEstimate)  # ask → ready of recent replicas

    @property
    def name(self) -> str:
        return self.deployment.service

    @property
    def metric_name(self) -> str:
        return f"{self.deployment.service}.{self.deployment.namespace}"

    def refresh_ready(self) -> None:
        self.ready = [e for e in self.replicas.values() if e.state == "ready"]
        self.wake()

    def wake(self) -> None:
        if self.wakeups:
            for fut in self.wakeups:
                if not fut.done():
                    fut.set_result(None)
            self.wakeups.clear()

    def status_json(self) -> dict[str, Any]:
        """A ``FunctionStatus`` (faas-provider types / spec.openapi.yml)."""
        out = self.deployment.to_json()
        out["invocationCount"] = self.invocations
        out["replicas"] = self.desired
        out["availableReplicas"] = len(self.ready)
        out["createdAt"] = self.created_at.isoformat().replace("+00:00", "Z")
        return out


class ServiceUnavailable(RequestError):
    """No replica could take the request in time (503 or 429, with Retry-After)."""


def default_placer(name: str) -> Placer:
    from quart_provider.scheduling import make_placer

    return make_placer(name)


class EmbeddedGateway:
    """Registry + replica sets over a list of hosts. One per process; all methods run on its event loop."""

    def __init__(self, config: GatewayConfig, hosts: list[Host], placer: Placer | None = None) -> None:
        self.config = config
        self.hosts: dict[str, Host] = {h.name: h for h in hosts}
        self.placer = placer or default_placer(config.placer)
        self.functions: dict[str, FunctionState] = {}
        self.images = ImageIndex(config.state_dir / INDEX_FILE)
        self.metrics = GatewayMetrics(lambda: {f.metric_name: f.desired for f in self.functions.values()})
        # scheduler metrics (cache hits, replica-ready time by source, host use) on the same /metrics
        self.scheduler_metrics = SchedulerMetrics()
        self.metrics.registry.register(SchedulerCollector(self.scheduler_metrics))
        self._placed: dict[str, tuple[float, str, bool]] = {}  # replica id → (asked at, planned source, key)
        self._pins: dict[str, tuple[str, ...]] = {}  # host → key-stage zygotes last pinned there (keep_cached)
        self._param_bytes: dict[str, tuple[int, int]] = {}  # function → (generation, stage parameter bytes)
        self.invoke_hooks: list[InvokeHook] = []
        self.shutdown_callbacks: list[Callable[[], Awaitable[None]]] = []
        self.key_history: dict[str, int] = {}
        self._kick = asyncio.Event()
        self._closing = False
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._host_views: dict[str, HostView] = {}
        self._probe_session: aiohttp.ClientSession | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._reconcile_forever(), name="gateway-reconcile")

    async def close(self) -> None:
        """Stop the plugin hooks, every replica this gateway started, and the hosts."""
        for callback in reversed(self.shutdown_callbacks):
            with contextlib.suppress(Exception):
                await callback()
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

    # ---------------------------------------------------------------- control plane

    def get(self, name: str) -> FunctionState:
        fn = self.functions.get(name)
        if fn is None:
            raise RequestError(404, f"function {name!r} not found", "functionName")
        return fn

    async def deploy(self, deployment: FunctionDeployment) -> FunctionState:
        """Create a function (POST /system/functions); starts ``com.openfaas.scale.min`` replicas."""
        if deployment.service in self.functions:
            raise RequestError(400, f"function {deployment.service!r} already exists; update it with "
                                    "PUT /system/functions", "service")
        runnable = resolve(deployment, self.images)
        fn = FunctionState(deployment, runnable, deployment.min_replicas, datetime.now(UTC))
        self.functions[deployment.service] = fn
        self.kick()
        return fn

    async def update(self, deployment: FunctionDeployment) -> FunctionState:
        """Replace a function's spec (PUT /system/functions): a rolling update to a new generation.

        When what a replica runs is unchanged (same image resolution, environment, limits and
        concurrency: only labels such as ``com.openfaas.scale.min/max`` or annotations differ), the
        running replicas are kept and only the desired count is clamped to the new bounds.
        """
        fn = self.get(deployment.service)
        runnable = resolve(deployment, self.images)
        before = self.replica_spec(fn)
        fn.deployment, fn.runnable = deployment, runnable
        fn.desired = min(max(fn.desired, deployment.min_replicas), deployment.max_replicas)
        if self.replica_spec(fn) != before:
            fn.generation += 1
            await self._invalidate(fn.name)
        self.kick()
        return fn

    async def remove(self, name: str) -> None:
        """Delete a function (DELETE /system/functions): drain and stop all its replicas."""
        fn = self.get(name)
        del self.functions[name]
        fn.desired = 0
        for endpoint in list(fn.replicas.values()):
            self._drain_and_stop(fn, endpoint)
        fn.wake()
        await self._invalidate(name)

    async def scale(self, name: str, replicas: int, key: bool = False) -> int:
        """Set desired replicas (clamped to ``com.openfaas.scale.max``); returns the count applied."""
        if replicas < 0:
            raise RequestError(400, f"replicas must not be negative, got {replicas}", "replicas")
        fn = self.get(name)
        applied = min(replicas, fn.deployment.max_replicas)
        if key and applied > fn.desired:
            self.key_history[name] = self.key_history.get(name, 0) + 1
        fn.desired = applied
        self.kick()
        return applied

    async def update_limits(self, name: str, cpus: float | None = None, memory_bytes: int | None = None) -> None:
        """Change a function's CPU / memory limits (the CPU compensator's actuator): rolling update."""
        fn = self.get(name)
        old = fn.deployment.limits or Resources()
        limits = Resources(
            memory=str(memory_bytes) if memory_bytes else old.memory,
            cpu=f"{cpus:g}" if cpus else old.cpu,
            memory_bytes=memory_bytes or old.memory_bytes,
            cpus=cpus or old.cpus,
        )
        await self.update(replace(fn.deployment, limits=limits))

    async def _invalidate(self, name: str) -> None:
        await asyncio.gather(*(h.invalidate(name) for h in self.hosts.values()), return_exceptions=True)

    # ---------------------------------------------------------------- plugin access

    def add_invoke_hook(self, hook: InvokeHook) -> None:
        """Let ``hook(request, name, subpath)`` answer ``/function/<name>`` for names not deployed here."""
        self.invoke_hooks.append(hook)

    def ready_endpoints(self, name: str) -> list[Endpoint]:
        """The ready replicas of a function (live objects: ``in_flight`` is current)."""
        fn = self.functions.get(name)
        return list(fn.ready) if fn else []

    def pipelines(self) -> dict[str, list[str]]:
        """model → its stage functions in stage order (from the ``com.quart.*`` labels)."""
        stages: dict[str, list[tuple[int, str]]] = {}
        for fn in self.functions.values():
            model = fn.deployment.model
            if model:
                index = int(fn.deployment.labels.get("com.quart.stage", "0") or 0)
                stages.setdefault(model, []).append((index, fn.name))
        return {m: [name for _, name in sorted(s)] for m, s in stages.items()}

    def host_views(self) -> list[HostView]:
        """What the last reconcile saw of every host."""
        return list(self._host_views.values())

    # ---------------------------------------------------------------- data plane

    def acquire_nowait(self, fn: FunctionState) -> Endpoint | None:
        """The least-loaded ready replica with a free slot, its in-flight count taken; None if none."""
        best: Endpoint | None = None
        for endpoint in fn.ready:
            if best is None or endpoint.in_flight < best.in_flight:
                best = endpoint
        if best is None:
            return None
        limit = fn.deployment.concurrency
        if limit and best.in_flight >= limit:
            return None
        best.in_flight += 1
        return best

    async def acquire(self, fn: FunctionState) -> Endpoint:
        """Like :meth:`acquire_nowait`, waiting up to ``ready_wait_s`` (scales from zero if needed).

        Raises :class:`ServiceUnavailable`: 429 when too many requests wait or all replicas stay busy,
        503 when no replica became ready in time.
        """
        endpoint = self.acquire_nowait(fn)
        if endpoint is not None:
            return endpoint
        if fn.waiting >= self.config.max_waiting:
            raise ServiceUnavailable(429, f"function {fn.name!r} is overloaded: {fn.waiting} requests already "
                                          "wait for a replica", None)
        if fn.desired == 0:
            fn.desired = max(1, fn.deployment.min_replicas)  # scale from zero
            self.kick()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.ready_wait_s
        fn.waiting += 1
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or fn.name not in self.functions:
                    break
                fut = loop.create_future()
                fn.wakeups.append(fut)
                with contextlib.suppress(TimeoutError):
                    await within(remaining, fut)
                endpoint = self.acquire_nowait(fn)
                if endpoint is not None:
                    return endpoint
        finally:
            fn.waiting -= 1
        if fn.ready:
            raise ServiceUnavailable(429, f"all replicas of {fn.name!r} stayed at their concurrency limit for "
                                          f"{self.config.ready_wait_s:g} s", None)
        raise ServiceUnavailable(503, f"no replica of {fn.name!r} became ready within "
                                      f"{self.config.ready_wait_s:g} s", None)

    def record_invocation(self, name: str, code: int, seconds: float) -> None:
        """Count an invocation served outside the proxy (the router's per-stage calls) like the proxy does."""
        fn = self.functions.get(name)
        if fn is None:
            return
        fn.invocations += 1
        self.metrics.invocation_started(fn.metric_name)
        self.metrics.invocation_done(fn.metric_name, code, seconds)

    def mark_unreachable(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """A replica refused a connection: route nothing more to it; the next reconcile confirms or removes it."""
        if endpoint.state == "ready":
            endpoint.state, endpoint.probed = "starting", False  # the host's next report says ready if a blip
            fn.refresh_ready()
            self.kick()

    def release(self, fn: FunctionState, endpoint: Endpoint) -> None:
        endpoint.in_flight -= 1
        endpoint.served += 1
        if fn.wakeups:
            fn.wake()

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[Endpoint]:
        """``async with gateway.lease(fn) as ep``: a ready replica for one request (the router's path)."""
        fn = self.get(name)
        endpoint = await self.acquire(fn)
        try:
            yield endpoint
        finally:
            self.release(fn, endpoint)

    # ---------------------------------------------------------------- reconciliation

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
        results = await asyncio.gather(*(self.hosts[n].replicas() for n in names), return_exceptions=True)
        seen: dict[str, ReplicaStatus] = {}
        polled_hosts: set[str] = set()
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("host %s did not answer: %s", name, result)
                continue
            polled_hosts.add(name)
            seen.update((r.id, r) for r in result)
        now = time.monotonic()
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
                if endpoint.state in ("starting", "ready") and status.state != endpoint.state:
                    if endpoint.probed and endpoint.state == "ready" and status.state == "starting":
                        continue  # our probe got the health answer first; the host's report lags behind
                    endpoint.state = status.state
                    changed = True
                    if endpoint.state == "ready":
                        self._replica_ready(fn, endpoint)
                if endpoint.state == "starting" and now - endpoint.started_at > self.config.start_timeout_s:
                    log.warning("replica %s of %s not ready after %.0f s: replacing it", endpoint.id, fn.name,
                                self.config.start_timeout_s)
                    self._drain_and_stop(fn, endpoint)
                    changed = True
            if changed:
                fn.refresh_ready()
        await self._converge(now)

    async def _converge(self, now: float) -> None:
        requests: list[ReplicaRequest] = []
        for fn in self.functions.values():
            current = [e for e in fn.replicas.values()
                       if e.generation == fn.generation and e.state in ("starting", "ready")]
            missing = shortfall(fn.desired, len(current), fn.pending_starts)
            if missing and now >= fn.retry_at:
                requests.append(ReplicaRequest(fn.name, missing, param_bytes=self._stage_param_bytes(fn),
                                               key=fn.name in self.key_history))
            for endpoint in choose_surplus(current, fn.desired):
                self._drain_and_stop(fn, endpoint)
            ready_current = sum(1 for e in current if e.state == "ready")
            old = [e for e in fn.replicas.values() if e.generation != fn.generation and e.state != "draining"]
            if old and (ready_current >= fn.desired or fn.desired == 0):
                for endpoint in old:
                    self._drain_and_stop(fn, endpoint)
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
                size = resolve_stage(fn.name, self.replica_spec(fn).env).param_bytes
            except (UnknownStage, ValueError, OSError) as exc:
                log.warning("%s: parameter size unknown (%s); placing it as parameter-free", fn.name, exc)
        self._param_bytes[fn.name] = (fn.generation, size)
        return size

    async def _place(self, requests: list[ReplicaRequest]) -> None:
        names = list(self.hosts)
        reports = await asyncio.gather(*(self.hosts[n].report() for n in names), return_exceptions=True)
        views: list[HostView] = []
        for name, report in zip(names, reports, strict=True):
            if isinstance(report, BaseException):
                log.warning("host %s gave no report: %s", name, report)
                continue
            pending = sum(1 for t in self._tasks if t.get_name().startswith(f"start:{name}:"))
            views.append(replace(report, gpu_used=min(report.gpu_slots, report.gpu_used + pending)))
        self._host_views = {v.name: v for v in views}
        self.scheduler_metrics.record_hosts(views)
        result = self.placer.place(views, requests, dict(self.key_history))
        self.scheduler_metrics.record_schedule(result)
        await self._pin_kept(result, [v.name for v in views])
        asked_at = time.monotonic()
        for fn in self.functions.values():
            fn.unplaced = 0
        for req in result.unplaced:
            if req.function in self.functions:
                self.functions[req.function].unplaced += req.count
        for placement in result.placements:
            fn = self.functions.get(placement.function)
            if fn is None or placement.host not in self.hosts:
                continue
            fn.pending_starts += 1
            self._spawn(self._start_placed(fn, placement, fn.generation, asked_at),
                        f"start:{placement.host}:{fn.name}")

    async def _pin_kept(self, result: ScheduleResult, hosts: list[str]) -> None:
        """Make ``keep_cached`` binding (QUART §6): each host's KeysManager evicts those key-stage zygotes last
        and never to cache another stage. Sent only when a host's set changes; a failure is logged, not fatal."""
        calls, names = [], []
        for name in hosts:
            kept = tuple(sorted(f for f, h in result.keep_cached if h == name))
            pin = getattr(self.hosts[name], "pin", None)  # KeysManager hosts pin; process hosts have nothing to pin
            if pin is not None and self._pins.get(name, ()) != kept:
                calls.append(within(5.0, pin(list(kept))))  # a stuck host must not stall placing
                names.append((name, kept))
        for (name, kept), outcome in zip(names, await asyncio.gather(*calls, return_exceptions=True), strict=True):
            if isinstance(outcome, BaseException):
                log.warning("pinning %s on host %s failed: %s", ", ".join(kept) or "nothing", name, outcome)
            else:
                self._pins[name] = kept

    async def _start_placed(self, fn: FunctionState, placement: Placement, generation: int, asked_at: float) -> None:
        """Start one placed replica and remember when it was asked for (its ready time is measured from then)."""
        before = set(fn.replicas)
        await self._start_replica(fn, placement.host, generation)
        for rid, endpoint in list(fn.replicas.items()):
            if rid not in before and endpoint.host == placement.host and rid not in self._placed:
                self._placed[rid] = (asked_at, placement.source, placement.key)
                if endpoint.state == "ready":
                    self._replica_ready(fn, endpoint)

    def _replica_ready(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """The replica-ready hook: count the scale-up (source, ready ms) in the scheduler metrics, once.

        A stage replica counts as a cache hit only if its host held the stage when it was placed *and* it was
        forked from a zygote that was already there (a KeysManagerHost reports a start that had to load the
        zygote as cold)."""
        placed = self._placed.pop(endpoint.id, None)
        if placed is None:
            return
        asked_at, planned, key = placed
        source = "cold" if "cold" in (planned, endpoint.source) else endpoint.source
        self.scheduler_metrics.record_replica(fn.name, endpoint.host, source, 1000 * (time.monotonic() - asked_at),
                                              key=key)
        fn.start_time.note(time.monotonic() - asked_at)

    def replica_spec(self, fn: FunctionState) -> ReplicaSpec:
        dep = fn.deployment
        env = {**dep.env_vars, **fn.runnable.env}
        env.setdefault("QUART_MAX_BODY_BYTES", str(self.config.max_body_bytes))
        return ReplicaSpec(function=fn.name, kind=fn.runnable.kind, env=env, cpus=dep.cpus,
                           memory_bytes=dep.memory_bytes, concurrency=dep.concurrency, argv=fn.runnable.argv,
                           health_path=fn.runnable.health_path, param_cache=dep.param_cache)

    async def _start_replica(self, fn: FunctionState, host: str, generation: int) -> None:
        try:
            statuses = await self.hosts[host].start(self.replica_spec(fn), 1)
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
                                else "starting", status.source, generation, now)
            if self.functions.get(fn.name) is not fn:  # removed meanwhile
                self._spawn(self._stop_now(endpoint), f"stop:{endpoint.id}")
                continue
            fn.replicas[endpoint.id] = endpoint
            if endpoint.state == "starting":
                self._spawn(self._probe_until_ready(fn, endpoint), f"probe:{endpoint.id}")
        fn.refresh_ready()
        self.kick()

    def _prober(self) -> aiohttp.ClientSession:
        if self._probe_session is None or self._probe_session.closed:
            self._probe_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._probe_session

    async def _probe_until_ready(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """GET the starting replica's health path (as its host does) and route to it as soon as it answers 200.

        Without this, a replica becomes routable only at the next reconcile poll of its host
        (``reconcile_interval_s``), which was most of a fork's ask→ready time. The interval starts at
        ``ready_probe_s`` and grows ×1.5 up to 0.1 s; a connection waits in the listen backlog until the
        replica serves, so one probe often spans the whole start.
        """
        url = endpoint.url + fn.runnable.health_path
        delay = self.config.ready_probe_s
        deadline = endpoint.started_at + self.config.start_timeout_s
        while endpoint.state == "starting" and fn.replicas.get(endpoint.id) is endpoint:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return  # the reconcile loop replaces it
            try:
                async with self._prober().get(url, timeout=aiohttp.ClientTimeout(total=min(2.0, remaining))) as res:
                    if res.status == 200:
                        if endpoint.state == "starting" and fn.replicas.get(endpoint.id) is endpoint:
                            endpoint.state, endpoint.probed = "ready", True
                            self._replica_ready(fn, endpoint)
                            log.debug("%s ready %.1f ms after start", endpoint.id,
                                      1000 * (time.monotonic() - endpoint.started_at))
                            fn.refresh_ready()
                            self.kick()  # a rolling update may now retire old replicas
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(delay)
            delay = min(0.1, delay * 1.5)

    def _drain_and_stop(self, fn: FunctionState, endpoint: Endpoint) -> None:
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
