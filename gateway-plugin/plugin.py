"""Attach the router, metrics and controller to the embedded gateway (``quartctl up`` calls ``attach``).

- ``POST /function/<model>`` for a pipeline (functions labelled ``com.quart.model``) goes to the
  router: the gateway's pipeline route (``gateway.route_pipelines(router.answer)``), which its fast
  front calls with the body read; deployed stage functions are still invocable one by one.
- ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and generation bodies on
  ``POST /function/<model>`` of a decoder pipeline go to the generation API (``gateway_plugin.generation``;
  ``gateway.route_generation``: those calls take the gateway's aiohttp server, which can stream).
- The per-stage gauges join the gateway's ``/metrics``; ``GET /function/quart-plugin/snapshot``
  answers the current per-stage snapshots as JSON, ``.../timeline`` the controller's history,
  ``.../sessions`` the generation sessions in flight and the KV positions booked per replica.
- The controller scales stages through the configured actuator (default: in-process gateway calls,
  whose placer is the scheduler). Settings: ``PluginConfig.from_env`` (``QUART_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, replace
from typing import IO, Any

from aiohttp import web
from gateway_plugin.batching import BatchLimits, batch_state, limits_from_labels
from gateway_plugin.config import PluginConfig
from gateway_plugin.controller import Controller
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.openai_api import GenerationAPI
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.policies import make_policy
from gateway_plugin.router import Router
from gateway_plugin.snapshot import Policy
from gateway_plugin.snapshot_builder import StageState
from gateway_plugin.webui import make_ui_hook
from quart_kernel.admission import ServiceTimes
from quart_kernel.capacity import not_ready_reason
from quart_stage import labels as vocab
from quart_stage.config import computes_on_cpu
from quart_stage.errors import QuartError
from quart_transport.responses import error_of

log = logging.getLogger("quart.plugin")

PLUGIN_PATH = "quart-plugin"  # /function/quart-plugin/{snapshot,timeline}


class GatewayView:
    """ReplicaSource + Inventory over the in-process EmbeddedGateway."""

    def __init__(self, gateway: Any, default_concurrency: int = 1) -> None:
        self.gateway = gateway
        self.default_concurrency = default_concurrency
        self._unplaced: dict[str, int] = {}  # replicas that could not be placed, as last logged
        self._meta: dict[str, tuple[Any, tuple[float, int]]] = {}  # function -> (its deployment, stage_meta)
        self._batch: dict[str, tuple[Any, BatchLimits]] = {}  # function -> (its deployment, its batch labels)
        self.batch_default = BatchLimits()  # the plugin's QUART_BATCH_MAX / QUART_BATCH_WAIT_MS (Plugin sets it)

    def pipelines(self) -> dict[str, list[str]]:
        return self.gateway.registry.pipelines()

    def ready(self, function: str) -> list[Any]:
        return self.gateway.ready_endpoints(function, partial=True)

    def concurrency(self, function: str) -> int:
        fn = self.gateway.functions.get(function)
        return (fn.deployment.concurrency if fn else 0) or self.default_concurrency

    def take(self, function: str, replica: Any) -> None:
        replica.in_flight += 1

    def wait(self, function: str) -> asyncio.Future[None]:
        """Resolved at the function's next release (the router's or the proxy's) or ready-list change: the
        same wake-ups the proxy's waiting calls get (``FunctionState.wakeups``)."""
        future = asyncio.get_running_loop().create_future()
        fn = self.gateway.functions.get(function)
        if fn is not None:
            fn.add_waiter(future)
        return future

    def waiting(self, function: str) -> int:
        """Calls of ``function`` through the proxy waiting for a slot (the controller sees them in the queue)."""
        fn = self.gateway.functions.get(function)
        return fn.waiting if fn is not None else 0

    def service_times(self, function: str) -> ServiceTimes:
        fn = self.gateway.functions.get(function)
        return fn.service if fn is not None else ServiceTimes()

    def mark_unreachable(self, function: str, replica: Any) -> None:
        """The router found nothing listening on ``replica``: out of the ready list until its host says."""
        fn = self.gateway.functions.get(function)
        if fn is not None:
            self.gateway.balancer.mark_unreachable(fn, replica)

    def give_back(self, function: str, replica: Any) -> None:
        fn = self.gateway.functions.get(function)
        if fn is not None:
            self.gateway.balancer.release(fn, replica)  # wakes the gateway's own waiters too
        else:
            replica.in_flight -= 1

    def note_held(self, function: str, replica: Any, held: tuple[int, int]) -> None:
        self.gateway.note_held(function, replica, held)

    def note_decision(self, function: str, text: str) -> None:
        """The controller changed ``function``'s replicas: kept for ``/system/functions`` (lastDecision)."""
        fn = self.gateway.functions.get(function)
        if fn is not None:
            fn.last_decision = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {text}"

    def check_placement(self, function: str) -> None:
        """Log, once per change, the replicas of ``function`` that cannot be placed and why."""
        fn = self.gateway.functions.get(function)
        unplaced = fn.unplaced if fn is not None else 0
        if unplaced != self._unplaced.get(function, 0) and fn is not None:
            if unplaced:
                log.warning("cannot place %d replica(s) of %s: %s", unplaced, function,
                            not_ready_reason(fn, self.gateway.functions.values(), self.gateway.hosts))
            else:
                log.info("all replicas of %s are placed again", function)
        self._unplaced[function] = unplaced

    def scale_from_zero(self, functions: list[str]) -> None:
        """A call came for a pipeline: its stages at zero replicas get ``max(1, com.openfaas.scale.min)``, as the
        OpenFaaS gateway's scale from zero does for a function (the balancer does the same for a direct call)."""
        woken = False
        for name in functions:
            fn = self.gateway.functions.get(name)
            if fn is not None and fn.desired == 0:  # through the registry: saved, counted, reconciled
                self.gateway.registry.set_desired(name, max(1, fn.deployment.min_replicas))
                woken = True
        if woken:
            log.info("scale from zero: %s", ", ".join(functions))
            self.gateway.kick()

    def stage_state(self, function: str) -> StageState:
        fn = self.gateway.functions[function]
        dep = fn.deployment
        labels = vocab.StageLabels.lenient(dep.labels)
        return StageState(
            ready=len(fn.ready), desired=fn.desired, cpus=dep.cpus or 1.0,
            min_replicas=dep.min_replicas, max_replicas=dep.max_replicas,
            concurrency=dep.concurrency or self.default_concurrency,
            param_bytes=labels.param_bytes, profiled_service_s=labels.profile_ms / 1000.0,
            start_s=fn.start_time.seconds, cpu_bound=computes_on_cpu(dep.env_vars),
            **batch_state(self.batch_limits(function, self.batch_default)),
        )

    def stage_meta(self, function: str) -> tuple[float, int]:
        """(cpus, parameter bytes) of a stage, read from its labels once per deployment (the router asks per call)."""
        fn = self.gateway.functions.get(function)
        if fn is None:
            return (1.0, 0)
        cached = self._meta.get(function)
        if cached is None or cached[0] is not fn.deployment:
            state = self.stage_state(function)
            cached = self._meta[function] = (fn.deployment, (state.cpus, state.param_bytes))
        return cached[1]

    def batch_limits(self, function: str, default: BatchLimits) -> BatchLimits:
        """What the function's ``com.quart.batch.*`` labels say (``default`` where they say nothing), once per deployment."""
        fn = self.gateway.functions.get(function)
        if fn is None:
            return default
        cached = self._batch.get(function)
        if cached is None or cached[0] is not fn.deployment:
            cached = self._batch[function] = (fn.deployment, limits_from_labels(fn.deployment.labels, default))
        return cached[1]

    def decode_batch_max(self, function: str, default: int) -> int:
        """Sessions per batched decode step on the function's replicas: its ``com.quart.batch.decode-max`` label
        (validated at deploy), else ``default`` (``QUART_GEN_DECODE_BATCH_MAX``)."""
        fn = self.gateway.functions.get(function)
        if fn is None:
            return default
        return vocab.StageLabels.lenient(fn.deployment.labels).decode_batch or default

    def model_dir(self, model: str) -> str | None:
        """Where a pipeline's tokenizer is: its stage 0's ``QUART_MODEL_DIR``, else its ``QUART_MODEL_URL``."""
        stages = self.pipelines().get(model)
        fn = self.gateway.functions.get(stages[0]) if stages else None
        env = fn.deployment.env_vars if fn is not None else {}
        return env.get("QUART_MODEL_DIR") or env.get("QUART_MODEL_URL")


def machine_cores() -> float:
    """The cores this process may run on: where the embedded gateway's hosts start their replicas."""
    return float(len(os.sched_getaffinity(0)))


def online_cv_trainer(config: PluginConfig):
    """The background CV-model trainer QUART uses by default (none with a trained model given or QUART_CV_ONLINE=0)."""
    if not config.cv_online or config.cv_model_path:
        return None
    from gateway_plugin.policies.cv_online import OnlineCVTrainer

    return OnlineCVTrainer()


def policy_factory(config: PluginConfig, **overrides: Any):
    """A zero-argument factory of the configured policy, with the trained models it needs loaded once."""
    extra: dict[str, Any] = dict(overrides)
    if config.policy == "quart":
        if config.cv_model_path and "cv_model" not in extra:
            from gateway_plugin.policies.cv_model import load_cv_model

            extra["cv_model"] = load_cv_model(config.cv_model_path)
        if config.cpu_profile_path and "cpu_model" not in extra:
            from gateway_plugin.policies.cpu_model import CPULatencyModel, profiling_rows

            with open(config.cpu_profile_path) as fh:
                extra["cpu_model"] = CPULatencyModel.fit(profiling_rows(fh))
    make_policy(config.policy, **dict(extra))  # fail now, not at the first control step

    def factory() -> Policy:
        return make_policy(config.policy, **dict(extra))

    return factory


def make_actuator(config: PluginConfig, gateway: Any | None = None, password: str | None = None):
    if config.actuator == "gateway":
        if gateway is None:
            raise ValueError("the gateway actuator needs the in-process embedded gateway")
        from gateway_plugin.actuators.gateway import GatewayActuator

        return GatewayActuator(gateway)
    if config.actuator in ("rest", "faas-cli"):
        if not config.gateway_url:
            raise ValueError(f"the {config.actuator} actuator needs QUART_GATEWAY_URL")
        if password is None and config.gateway_password_file:
            with open(config.gateway_password_file) as fh:
                password = fh.read().strip()
        password = password or ""
        if config.actuator == "rest":
            from gateway_plugin.actuators.rest import RestActuator

            return RestActuator(config.gateway_url, config.gateway_user, password)
        from gateway_plugin.actuators.faas_cli import FaasCliActuator

        return FaasCliActuator(config.gateway_url, config.gateway_user, password)
    if config.actuator == "none":
        return _NoActuator()
    raise ValueError(f"unknown actuator {config.actuator!r}; one of gateway, rest, faas-cli, none")


class _NoActuator:
    """Observe only: decisions are logged, nothing is scaled."""

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        return None

    async def set_cpus(self, function: str, cpus: float) -> None:
        return None


class _RegistryBridge:
    """Lets the gateway's prometheus registry also collect the plugin's gauges."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def collect(self):
        yield from self.registry.collect()


class Plugin:
    """Router + metrics + controller bound to one embedded gateway."""

    def __init__(self, gateway: Any, config: PluginConfig | None = None, factory=None, actuator=None) -> None:
        self.config = config or PluginConfig.from_env()
        self.gateway = gateway
        self.view = GatewayView(gateway, self.config.default_concurrency)
        self._files: list[IO[str]] = []
        records = self._open(self.config.records_path)
        self.collector = MetricsCollector(self.config.window_s, records)
        batching = self.view.batch_default = BatchLimits(self.config.batch_max, self.config.batch_wait_ms / 1000)
        self.router = Router(self.view, self.view.pipelines, self.config, self.collector, self.view.stage_meta,
                             on_call=getattr(gateway, "record_invocation", None),
                             batch_limits=lambda fn: self.view.batch_limits(fn, batching))
        generation = GenerationConfig.from_env()
        self.engine = SessionEngine(self.view, generation, on_call=getattr(gateway, "record_invocation", None),
                                    decode_limit=lambda fn: self.view.decode_batch_max(fn, generation.decode_batch_max),
                                    collector=self.collector)
        self.generation = GenerationAPI(self.engine, self.view.pipelines, self.view.model_dir, self.engine.config,
                                        self.collector, one_shot=self.router.answer)
        self.controller = Controller(
            self.view, self.router, self.collector, actuator or make_actuator(self.config, gateway),
            factory or policy_factory(self.config), self.config, log_file=self._open(self.config.control_log_path),
            cv_trainer=online_cv_trainer(self.config), generation=self.engine,
            compute_cores=machine_cores() if self.config.compute_cores < 0 else self.config.compute_cores,
        )
        if hasattr(gateway, "watch_sessions"):  # its scale-down keeps replicas with sessions, drains them
            gateway.watch_sessions(self.engine.book.booked)
        if hasattr(gateway, "watch_demand"):  # a whole ParaServe group keeps the workers its sessions need
            gateway.watch_demand(self.engine.group_chains.demand)
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def _open(self, path: str) -> IO[str] | None:
        if not path:
            return None
        fh = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._files.append(fh)
        return fh

    async def start(self) -> None:
        await self.router.start()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.controller.run(self._stop), name="quart-controller")

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.router.close()
        await self.engine.close()
        closer = getattr(self.controller.actuator, "close", None)
        if closer is not None:
            await closer()
        for fh in self._files:
            fh.close()
        self._files.clear()

    async def hook(self, request: web.Request, name: str, tail: str) -> web.StreamResponse | None:
        """``/function/quart-plugin/...`` (pipelines go to the gateway's pipeline route, not here)."""
        if name == PLUGIN_PATH:
            if tail == "policy" and request.method == "POST":
                return await self._switch_policy(request)
            return self._introspect(tail, request.query.get("since"))
        return None

    def _authorised(self, request: web.Request) -> bool:
        cfg = getattr(self.gateway, "config", None)
        if cfg is None or not getattr(cfg, "auth", False):
            return True
        from quart_transport.auth import load_or_create

        return load_or_create(cfg.credentials_dir).check(request.headers.get("Authorization"))

    async def _switch_policy(self, request: web.Request) -> web.Response:
        """``POST /function/quart-plugin/policy`` {"policy": name, "config": {...}} (basic auth): swap the
        policy of every pipeline; the new one starts with fresh state. Answers the controller's clock."""
        if not self._authorised(request):
            return _error(401, "missing or wrong credentials: use the gateway's basic auth", None,
                          {"WWW-Authenticate": 'Basic realm="Restricted"'})
        try:
            body = json.loads(await request.read() or b"{}")
            name = body["policy"]
            overrides = body.get("config") or {}
            if not isinstance(overrides, dict):
                raise TypeError("config must be an object")
            factory = policy_factory(replace(self.config, policy=name), **overrides)
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            return _error(400, f"cannot switch policy: {exc}", "policy")
        self.config = replace(self.config, policy=name)
        self.controller.policy_factory = factory
        self.controller.policies.clear()
        log.info("policy switched to %s %s", name, overrides)
        return web.json_response({"policy": name, "time": self.controller.clock()})

    def _introspect(self, tail: str, since: str | None = None) -> web.Response:
        if tail == "snapshot":
            data = {m: asdict(s) for m, s in self.controller.last_snapshots.items()}
            return web.json_response(data, dumps=lambda d: json.dumps(d, default=str))
        if tail == "timeline":
            try:
                t0 = float(since) if since else float("-inf")
            except ValueError:
                return _error(400, f"since must be a number, got {since!r}", "since")
            return web.json_response([row for row in self.controller.timeline if row["time"] >= t0][-20000:])
        if tail == "sessions":  # generation sessions in flight and the KV positions booked per replica
            return web.json_response({"active": [{"id": x.id, "model": x.model, "tokens": x.fed, "replays": x.replays,
                                                  "moves": x.moves,
                                                  "replicas": [getattr(r, "id", None) for r in x.replicas]}
                                                 for x in self.engine.active.values()],
                                      "kv": self.engine.book.occupancy(), "moves": self.engine.moves,
                                      "room": self.engine.room.snapshot()})
        if tail == "metrics":
            return web.Response(body=self.collector.prometheus_text(), content_type="text/plain")
        return _error(404, f"unknown plugin path {tail!r}; use snapshot, timeline, sessions or metrics", "path")


def _error(status: int, message: str, field: str | None, headers: dict[str, str] | None = None) -> web.Response:
    """The plugin's error answers: the one error body (:class:`QuartError`)."""
    return error_of(QuartError(status, message, field, headers or {}), retry_after_s=1)


async def attach(gateway: Any, app: Any = None, config: PluginConfig | None = None) -> Plugin:
    """Called by the embedded gateway once it is up: hooks the router in and starts the controller."""
    plugin = Plugin(gateway, config)
    gateway.add_invoke_hook(plugin.hook)
    gateway.ui_hook = make_ui_hook(plugin)  # /ui/: the status page
    gateway.add_api_hook(plugin.generation.v1)
    gateway.route_pipelines(plugin.router.answer)
    gateway.route_generation(plugin.generation)
    if hasattr(gateway, "reserve_name"):
        gateway.reserve_name(PLUGIN_PATH, f"the QUART plugin (/function/{PLUGIN_PATH}/snapshot, timeline, sessions, ...)")
    gateway.shutdown_callbacks.append(plugin.close)
    with contextlib.suppress(Exception):
        gateway.metrics.registry.register(_RegistryBridge(plugin.collector.registry))
    await plugin.start()
    log.info("QUART plugin attached: policy %s, actuator %s, pid %d", plugin.config.policy,
             plugin.config.actuator, os.getpid())
    return plugin
