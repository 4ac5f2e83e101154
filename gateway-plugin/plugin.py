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
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import IO, Any

from aiohttp import web
from gateway_plugin.batching import BatchLimits
from gateway_plugin.config import PluginConfig
from gateway_plugin.controller import Controller
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.openai_api import GenerationAPI
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.policies import make_policy
from gateway_plugin.ports import PluginHost, Scaler
from gateway_plugin.router import Router
from gateway_plugin.snapshot import Policy
from gateway_plugin.view import GatewayView
from gateway_plugin.webui import make_ui_hook
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry
from quart_stage.errors import QuartError
from quart_transport.responses import error_of

log = logging.getLogger("quart.plugin")

PLUGIN_PATH = "quart-plugin"  # /function/quart-plugin/{snapshot,timeline}


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


def make_actuator(config: PluginConfig, gateway: PluginHost | None = None, password: str | None = None) -> Scaler:
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

    async def close(self) -> None:
        return None


class _RegistryBridge:
    """Lets the gateway's prometheus registry also collect the plugin's gauges."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()


class Plugin:
    """Router + metrics + controller bound to one embedded gateway."""

    def __init__(self, gateway: PluginHost, config: PluginConfig | None = None,
                 factory: Callable[[], Policy] | None = None, actuator: Scaler | None = None) -> None:
        self.config = config or PluginConfig.from_env()
        self.gateway = gateway
        self.view = GatewayView(gateway, self.config.default_concurrency)
        self._files: list[IO[str]] = []
        records = self._open(self.config.records_path)
        self.collector = MetricsCollector(self.config.window_s, records)
        batching = self.view.batch_default = BatchLimits(self.config.batch_max, self.config.batch_wait_ms / 1000)
        self.router = Router(self.view, self.view.pipelines, self.config, self.collector, self.view.stage_meta,
                             on_call=gateway.record_invocation,
                             batch_limits=lambda fn: self.view.batch_limits(fn, batching))
        generation = GenerationConfig.from_env()
        self.engine = SessionEngine(self.view, generation, on_call=gateway.record_invocation,
                                    decode_limit=lambda fn: self.view.decode_batch_max(fn, generation.decode_batch_max),
                                    collector=self.collector)
        self.generation = GenerationAPI(self.engine, self.view.pipelines, self.view.model_dir, self.engine.config,
                                        self.collector, one_shot=self.router.answer)
        self.scaler = actuator or make_actuator(self.config, gateway)
        self.controller = Controller(
            self.view, self.router, self.collector, self.scaler,
            factory or policy_factory(self.config), self.config, log_file=self._open(self.config.control_log_path),
            cv_trainer=online_cv_trainer(self.config), generation=self.engine, notes=self.view,
            compute_cores=machine_cores() if self.config.compute_cores < 0 else self.config.compute_cores,
        )
        gateway.watch_sessions(self.engine.book.booked)  # its scale-down keeps replicas with sessions, drains them
        self.engine.book.on_freed = gateway.sessions_freed  # … and a drain waiting for them is woken as they free
        gateway.watch_demand(self.engine.group_chains.demand)  # a whole ParaServe group keeps the workers it needs
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
        await self.scaler.close()
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
        return self.gateway.authorised(request.headers.get("Authorization"))

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
                                                  "replicas": [r.id if r is not None else None for r in x.replicas]}
                                                 for x in self.engine.active.values()],
                                      "kv": self.engine.book.occupancy(), "moves": self.engine.moves,
                                      "room": self.engine.room.snapshot()})
        if tail == "metrics":
            return web.Response(body=self.collector.prometheus_text(), content_type="text/plain")
        return _error(404, f"unknown plugin path {tail!r}; use snapshot, timeline, sessions or metrics", "path")


def _error(status: int, message: str, field: str | None, headers: dict[str, str] | None = None) -> web.Response:
    """The plugin's error answers: the one error body (:class:`QuartError`)."""
    return error_of(QuartError(status, message, field, headers or {}), retry_after_s=1)


async def attach(gateway: PluginHost, app: object = None, config: PluginConfig | None = None) -> Plugin:
    """Called by the embedded gateway once it is up: hooks the router in and starts the controller."""
    plugin = Plugin(gateway, config)
    gateway.add_invoke_hook(plugin.hook)
    gateway.set_ui_hook(make_ui_hook(plugin))  # /ui/: the status page
    gateway.add_api_hook(plugin.generation.v1)
    gateway.route_pipelines(plugin.router.answer)
    gateway.route_generation(plugin.generation)
    gateway.reserve_name(PLUGIN_PATH, f"the QUART plugin (/function/{PLUGIN_PATH}/snapshot, timeline, sessions, ...)")
    gateway.on_shutdown(plugin.close)
    with contextlib.suppress(Exception):  # a registry that already has these names: the plugin serves them itself
        gateway.add_collector(_RegistryBridge(plugin.collector.registry))
    await plugin.start()
    log.info("QUART plugin attached: policy %s, actuator %s, pid %d", plugin.config.policy,
             plugin.config.actuator, os.getpid())
    return plugin
