"""The embedded gateway: the composition root of the provider's parts, which its users call directly.

- ``gateway.registry`` (:class:`.registry.Registry`): ``deploy / update / remove / scale / update_limits / get``,
  ``pipelines()`` (the control plane: desired state, its one writer);
- ``gateway.reconciler`` (:class:`.reconciler.Reconciler`): polls every host, starts missing replicas where its
  ``placer`` says, stops surplus ones after draining them, rolls replicas over to a new generation on update;
- ``gateway.balancer`` (:class:`.balancer.Balancer`): ``acquire / release / mark_unreachable``: a ready replica
  of a function by the one pick rule (:func:`quart_kernel.picking.pick`), waiting (bounded) for one when none is
  ready or all are at their limit;

What is the gateway's own: its lifecycle (``start``: restore and adopt; ``close``), what spans the parts (the
replicas' log files on every host, a replica's held layers, invocations counted outside the proxy), and the
plugin's ports: the gateway is the plugin's ``Platform`` and ``PluginHost`` (``gateway_plugin.ports``, structural:
neither side imports the other; mypy checks it in ``tools/wiring.py``), among them the hooks the plugin attaches:

- ``add_invoke_hook``: the plugin's router takes ``/function/<name>`` for names that are not
  deployed functions (a pipeline, ``POST /function/<model>``);
- ``add_api_hook``: the plugin answers ``/v1/...`` (its OpenAI-compatible generation API).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.registry import Collector
from quart_kernel.admission import ServiceTimes
from quart_kernel.capacity import not_ready_reason
from quart_kernel.scheduling.paraserve_gen import GroupDemand
from quart_kernel.scheduling.types import Placer
from quart_provider.adopt import adopt_replicas
from quart_provider.async_queue import AsyncQueue
from quart_provider.balancer import Balancer
from quart_provider.body_gate import ByteGate
from quart_provider.config import GatewayConfig
from quart_provider.deploy_limits import DeployCaps
from quart_provider.hosts import Host, poll_replicas
from quart_provider.images import INDEX_FILE, ImageIndex
from quart_provider.metrics import GatewayMetrics
from quart_provider.reconciler import Reconciler
from quart_provider.registry import Registry
from quart_provider.replica_users import auto_uids
from quart_provider.scheduler_metrics import SchedulerCollector, SchedulerMetrics
from quart_provider.secrets import SecretStore
from quart_provider.store import FUNCTIONS_DIR, DeploymentStore
from quart_provider.types import (
    Endpoint,
    FunctionFacts,
    FunctionState,
    GenerationRoute,
    InvokeHook,
    PipelineRoute,
    ReplicaRef,
    UiHook,
)
from quart_transport.auth import load_or_create

log = logging.getLogger("quart.gateway")


def default_placer(name: str) -> Placer:
    from quart_kernel.scheduling import make_placer

    return make_placer(name)


class EmbeddedGateway:
    """Registry + reconciler + balancer over a list of hosts. One per process; all methods run on its loop."""

    def __init__(self, config: GatewayConfig, hosts: list[Host], placer: Placer | None = None) -> None:
        self.config = config
        self.hosts: dict[str, Host] = {h.name: h for h in hosts}
        self.images = ImageIndex(config.state_dir / INDEX_FILE)
        self.scheduler_metrics = SchedulerMetrics()  # cache hits, replica-ready time by source, host use
        self.secrets = SecretStore(config.function_secrets_dir, config.namespace)
        self.registry = Registry(self.images, self.hosts, config.max_body_bytes, self.kick, self._retire,
                                 self.secrets, DeploymentStore(config.state_dir / FUNCTIONS_DIR), config.uid_range(),
                                 DeployCaps(config.max_functions, config.max_labels, config.max_label_bytes))
        self.functions: dict[str, FunctionState] = self.registry.functions
        if config.replica_uids == "auto":
            log.info("replica users: %s", auto_uids()[1])
        self.key_history: dict[str, int] = self.registry.key_history
        self.reconciler = Reconciler(config, self.hosts, placer or default_placer(config.placer), self.functions,
                                     self.key_history, self.scheduler_metrics, self.registry.set_desired)
        self.balancer = Balancer(config, self.functions, self.kick,
                                 lambda fn: not_ready_reason(fn, self.functions.values(), self.hosts),
                                 self.registry.set_desired, self.reconciler.pending_starts)
        self.metrics = GatewayMetrics(lambda: {f.metric_name: f.desired for f in self.functions.values()})
        self.metrics.registry.register(SchedulerCollector(self.scheduler_metrics))  # on the same /metrics
        self.invoke_hooks: list[InvokeHook] = []
        self.ui_hook: UiHook | None = None  # answers /ui/<path> (the plugin's status page), behind basic auth
        self.api_hooks: list[Callable[[Any], Awaitable[Any]]] = []  # /v1/... (the plugin's generation API)
        self.pipeline_route: PipelineRoute | None = None  # POST /function/<model> (the plugin's router)
        # generation bodies on POST /function/<model> of a decoder pipeline (the plugin's generation API)
        self.generation_route: GenerationRoute | None = None
        # request bodies in flight, per gateway and per function / pipeline (quart_kernel.admission)
        self.body_gate = ByteGate(config.max_inflight_bytes, config.max_function_inflight_bytes,
                                  fallback_retry_s=config.retry_after_s)
        self.shutdown_callbacks: list[Callable[[], Awaitable[None]]] = []
        self.async_queue: AsyncQueue | None = None  # durable async calls (EmbeddedSystem connects it)
        self.async_unavailable = "no durable async queue was started"  # why, while async_queue is None
        self.keep_replicas = False  # True (`quartctl up --keep-hosts`): close() leaves replicas running (adopt.py)
        self._unplaced: dict[str, int] = {}  # replicas that could not be placed, as last logged (check_placement)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Restore the functions stored in the state folder (:mod:`.store`), then reconcile."""
        restored = self.registry.restore()
        if restored:
            log.info("restored %d function(s) from %s: %s", len(restored), self.config.state_dir / FUNCTIONS_DIR,
                     ", ".join(restored))
        await self._adopt()  # kept hosts (--keep-hosts), or replicas a KeysManager adopted from its predecessor
        self.reconciler.start()

    async def _adopt(self) -> None:
        """Track what kept hosts still run for the restored functions (:mod:`.adopt`); stop the rest."""
        for name, running in (await poll_replicas(self.hosts, self.config.host_timeout_s)).items():
            if isinstance(running, BaseException):
                continue  # the reconciler's host health decides about a host that does not answer
            adopted = adopt_replicas(self.functions, name, running, time.monotonic())
            tracked = {rid for fn in self.functions.values() for rid in fn.replicas}
            strays = [r.id for r in running if r.id not in tracked and r.state in ("starting", "ready")]
            for rid in strays:
                with contextlib.suppress(Exception):
                    await self.hosts[name].stop(rid)
            if adopted or strays:
                log.info("host %s: adopted %d replica(s), stopped %d not needed", name, len(adopted), len(strays))

    async def close(self) -> None:
        """Stop the plugin hooks, every replica this gateway started, and the hosts."""
        for callback in reversed(self.shutdown_callbacks):
            with contextlib.suppress(Exception):
                await callback()
        if self.keep_replicas:  # they outlive this gateway: the next one adopts them
            for fn in self.functions.values():
                fn.replicas.clear()
        await self.reconciler.close()

    def kick(self) -> None:
        """Reconcile now rather than at the next tick."""
        self.reconciler.kick()

    def _retire(self, fn: FunctionState, endpoint: Endpoint) -> None:
        self.reconciler.retire(fn, endpoint)

    async def log_files(self, name: str) -> list[tuple[str, Path]]:
        """(instance, file) of every replica log of ``name`` on every host; a host that fails to say is skipped."""
        found = await asyncio.gather(*(h.log_files(name) for h in self.hosts.values()), return_exceptions=True)
        return [item for files in found if not isinstance(files, BaseException) for item in files]

    # ---------------------------------------------------------------- the plugin's ports (gateway_plugin.ports)
    # PluginHost: the routes and hooks the plugin answers, its metrics, its shutdown, scaling, auth, counters

    def add_invoke_hook(self, hook: InvokeHook) -> None:
        """Let ``hook(request, name, subpath)`` answer ``/function/<name>`` for names not deployed here."""
        self.invoke_hooks.append(hook)

    def reserve_name(self, name: str, owner: str) -> None:
        """``/function/<name>`` is ``owner``'s (a plugin route): a deploy of that name is refused 409."""
        self.registry.reserved[name] = owner

    def add_api_hook(self, hook: Callable[[Any], Awaitable[Any]]) -> None:
        """Let ``hook(request)`` answer ``/v1/...`` (None: not its path)."""
        self.api_hooks.append(hook)

    def set_ui_hook(self, hook: UiHook) -> None:
        """Let ``hook(request, path)`` answer ``/ui/<path>`` (the plugin's status page), behind basic auth."""
        self.ui_hook = hook

    def route_pipelines(self, route: PipelineRoute) -> None:
        """Let ``route(model, method, sub-path, headers, body)`` answer ``/function/<model>`` for every pipeline
        :meth:`pipelines` names (its body read and counted here; the fast front calls it directly)."""
        self.pipeline_route = route

    def route_generation(self, route: GenerationRoute) -> None:
        """Let ``route.answer(request, model, body)`` answer generation bodies on ``/function/<model>`` of the
        pipelines ``route.generates(model)`` names (streamed: those calls take the aiohttp server)."""
        self.generation_route = route

    def on_shutdown(self, callback: Callable[[], Awaitable[None]]) -> None:
        """``callback()`` runs at :meth:`close`, before the replicas stop (last added, first run)."""
        self.shutdown_callbacks.append(callback)

    def add_collector(self, collector: Collector) -> None:
        """Collect ``collector``'s metrics on this gateway's ``/metrics`` too."""
        self.metrics.registry.register(collector)

    def authorised(self, authorization: str | None) -> bool:
        """Does an ``Authorization`` header pass this gateway's basic auth (always, with auth off)?"""
        if not self.config.auth:
            return True
        return load_or_create(self.config.credentials_dir).check(authorization)

    async def scale_function(self, name: str, replicas: int, key: bool = False) -> None:
        """The desired replicas of ``name`` (through the registry: saved, bounded, reconciled)."""
        await self.registry.scale(name, replicas, key=key)

    async def set_function_cpus(self, name: str, cpus: float) -> None:
        """The CPUs of each replica of ``name`` (resized in place where the host can)."""
        await self.registry.update_limits(name, cpus=cpus)

    def record_invocation(self, name: str, code: int, seconds: float) -> None:
        """Count an invocation served outside the proxy (the router's per-stage calls) like the proxy does."""
        fn = self.functions.get(name)
        if fn is None:
            return
        fn.invocations += 1
        self.metrics.invocation_started(fn.metric_name)
        self.metrics.invocation_done(fn.metric_name, code, seconds)

    def stage_status(self, name: str) -> dict[str, object] | None:
        """The status page's row of a function: desired, ready, bounds, why it is not ready, its replicas."""
        fn = self.functions.get(name)
        if fn is None:
            return None
        reason = not_ready_reason(fn, self.functions.values(), self.hosts)
        return {"desired": fn.desired, "ready": len(fn.ready), "min": fn.deployment.min_replicas,
                "max": fn.deployment.max_replicas, "unplaced": fn.unplaced, "reason": reason or fn.last_error,
                "replicas": [{"id": e.id, "host": e.host, "state": e.state, "source": e.source,
                              "in_flight": e.in_flight, "served": e.served,
                              "ready_ms": round(e.ready_ms, 1) if e.ready_ms is not None else None}
                             for e in fn.replicas.values()]}

    def hosts_status(self) -> list[dict[str, object]]:
        """The status page's hosts: name, GPU slots (its last report's; None before one), replicas there (not dead)."""
        slots = {h.name: h.gpu_slots for h in self.scheduler_metrics.snapshot().hosts}
        return [{"name": name, "slots": slots.get(name),
                 "used": sum(1 for fn in self.functions.values() for e in fn.replicas.values()
                             if e.host == name and e.state != "dead")}
                for name in sorted(self.hosts)]

    # Platform: inventory

    def pipelines(self) -> dict[str, list[str]]:
        return self.registry.pipelines()

    def function(self, name: str) -> FunctionFacts | None:
        fn = self.functions.get(name)
        return FunctionFacts(fn) if fn is not None else None

    # Platform: replicas and slots

    def ready_endpoints(self, name: str, partial: bool = False) -> list[Endpoint]:
        """The ready replicas of a function (live objects: ``in_flight`` is current); with ``partial``, also the
        live replicas that serve only the layers they hold so far (the pipeline router runs those)."""
        fn = self.functions.get(name)
        if fn is None:
            return []
        return [*fn.ready, *fn.partial] if partial else list(fn.ready)

    def ready(self, function: str) -> list[Endpoint]:
        """What the plugin's router may call: the ready replicas and the partial ones."""
        return self.ready_endpoints(function, partial=True)

    def take(self, function: str, replica: ReplicaRef) -> None:
        replica.in_flight += 1

    def give_back(self, function: str, replica: ReplicaRef) -> None:
        """A plugin call is over: its slot freed, the gateway's own waiters woken too."""
        fn = self.functions.get(function)
        if fn is not None and isinstance(replica, Endpoint):
            self.balancer.release(fn, replica)
        else:
            replica.in_flight -= 1

    def wait(self, function: str) -> asyncio.Future[None]:
        """Resolved at the function's next release (the router's or the proxy's) or ready-list change: the
        same wake-ups the proxy's waiting calls get (``FunctionState.wakeups``)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fn = self.functions.get(function)
        if fn is not None:
            fn.add_waiter(future)
        return future

    def waiting(self, function: str) -> int:
        """Calls of ``function`` through the proxy waiting for a slot."""
        fn = self.functions.get(function)
        return fn.waiting if fn is not None else 0

    def service_times(self, function: str) -> ServiceTimes:
        fn = self.functions.get(function)
        return fn.service if fn is not None else ServiceTimes()

    def note_held(self, function: str, replica: ReplicaRef, held: tuple[int, int]) -> None:
        """A replica's answer said which layers it holds now; a live replica holding all of them joins ``ready``."""
        if not isinstance(replica, Endpoint):
            replica.held = held
            return
        was_whole = replica.whole
        replica.held = held
        fn = self.functions.get(function)
        if fn is not None and replica.whole != was_whole:
            fn.refresh_ready()

    def mark_unreachable(self, function: str, replica: ReplicaRef) -> None:
        """The router found nothing listening on ``replica``: out of the ready list until its host says."""
        fn = self.functions.get(function)
        if fn is not None and isinstance(replica, Endpoint):
            self.balancer.mark_unreachable(fn, replica)

    def scale_from_zero(self, functions: Sequence[str]) -> None:
        """A call came for a pipeline: its stages at zero replicas get ``max(1, com.openfaas.scale.min)``, as the
        OpenFaaS gateway's scale from zero does for a function (the balancer does the same for a direct call)."""
        woken = False
        for name in functions:
            fn = self.functions.get(name)
            if fn is not None and fn.desired == 0:  # through the registry: saved, counted, reconciled
                self.registry.set_desired(name, max(1, fn.deployment.min_replicas))
                woken = True
        if woken:
            log.info("scale from zero: %s", ", ".join(functions))
            self.kick()

    # Platform: the controller's notes

    def note_decision(self, function: str, text: str) -> None:
        """The controller changed ``function``'s replicas: kept for ``/system/functions`` (lastDecision)."""
        fn = self.functions.get(function)
        if fn is not None:
            fn.last_decision = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {text}"

    def check_placement(self, function: str) -> None:
        """Log, once per change, the replicas of ``function`` that cannot be placed and why."""
        fn = self.functions.get(function)
        unplaced = fn.unplaced if fn is not None else 0
        if unplaced != self._unplaced.get(function, 0) and fn is not None:
            if unplaced:
                log.warning("cannot place %d replica(s) of %s: %s", unplaced, function,
                            not_ready_reason(fn, self.functions.values(), self.hosts))
            else:
                log.info("all replicas of %s are placed again", function)
        self._unplaced[function] = unplaced

    # Platform: the session host

    def watch_sessions(self, kv_tokens: Callable[[str], int]) -> None:
        """Let the reconciler read how many KV positions generation sessions hold on a replica (replica id → n):
        scale-down keeps replicas with sessions over those without, and drains one until its sessions are gone."""
        self.reconciler.kv_tokens = kv_tokens

    def sessions_freed(self, replica_id: str) -> None:
        """Sessions on ``replica_id`` freed their KV positions: a drain waiting for them looks again now."""
        self.reconciler.sessions_freed(replica_id)

    def watch_demand(self, demand: Callable[[str], GroupDemand]) -> None:
        """Let the reconciler read a function's generation demand (function → ``GroupDemand``: session arrivals,
        waiting, sessions per worker): a ParaServe group that becomes whole keeps the workers it needs."""
        self.reconciler.demand = demand
