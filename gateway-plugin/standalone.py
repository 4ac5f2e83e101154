"""The plugin as its own process in front of a real OpenFaaS gateway (function-level dispatch).

OpenFaaS hides individual pods behind ``/function/<name>``, so here a stage's "replicas" are
``availableReplicas`` virtual slots that all point at ``<gateway>/function/<stage>``; the router still
keeps one FIFO queue per stage and never sends a stage more concurrent requests than its replicas ×
concurrency, so the queue stays in the router where the policies can see it. Pipelines, replica
counts, CPUs and scale bounds come from ``GET /system/functions`` (polled); scaling goes through the
REST or faas-cli actuator. The generation API (``/v1/...``, generation bodies on ``/function/<model>``) is
served here too; OpenFaaS spreads a stage's calls over its pods, so a session's affinity holds with one
replica per stage, and with more a step that lands on a pod without the session is answered 409 and
replayed (correct, slower). With ``QUART_PLATFORM=kubernetes`` a stage's replicas are its pods instead, read from
the Kubernetes API and called directly (:mod:`gateway_plugin.kubernetes_pods`), so affinity holds with many pods.

    python -m gateway_plugin.standalone --gateway http://127.0.0.1:8080 --password-file pw --port 8081
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import aiohttp
import uvloop
from aiohttp import web
from gateway_plugin.batching import BatchLimits
from gateway_plugin.config import PluginConfig
from gateway_plugin.controller import Controller
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.openai_api import GenerationAPI
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.kubernetes_pods import PodDirectory, pod_directory
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.plugin import make_actuator, policy_factory
from gateway_plugin.ports import Replica
from gateway_plugin.replicas import ListedSlots, StaticReplica, Waiters
from gateway_plugin.router import Router, json_reply, web_response
from gateway_plugin.view import GatewayView
from quart_kernel.admission import ServiceTimes
from quart_kernel.scheduling.paraserve_gen import GroupDemand
from quart_stage import cliargs
from quart_stage import labels as vocab
from quart_stage.logs import configure as configure_logs
from quart_transport import namespaces
from quart_transport.exposition import render_registry
from quart_transport.quantities import parse_cpu
from quart_transport.tracing import traced, with_trace

from keysmanager.aio import wait_event

log = logging.getLogger("quart.standalone")
DEFAULT_NAMESPACE = "openfaas-fn"  # a FunctionStatus without one is in the gateway's default namespace


@dataclass(frozen=True, slots=True)
class OpenFaaSFunction:
    """A function as ``GET /system/functions`` lists it (:class:`~gateway_plugin.ports.FunctionFacts`)."""

    ready: int  # availableReplicas
    desired: int  # replicas
    cpus: float  # limits.cpu; 0: not limited
    min_replicas: int
    max_replicas: int
    concurrency: int  # com.quart.concurrency; 0: not set
    labels: Mapping[str, str]
    env: Mapping[str, str]
    namespace: str
    start_s: float = -1.0  # the gateway does not say

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> OpenFaaSFunction:
        labels = status.get("labels") or {}
        parsed = vocab.StageLabels.lenient(labels)
        cpu = (status.get("limits") or {}).get("cpu")
        return cls(ready=int(status.get("availableReplicas") or 0), desired=int(status.get("replicas") or 0),
                   cpus=parse_cpu(cpu) if cpu else 0.0, min_replicas=parsed.min_replicas,
                   max_replicas=parsed.max_replicas, concurrency=parsed.concurrency or 0, labels=labels,
                   env=status.get("envVars") or {}, namespace=status.get("namespace") or DEFAULT_NAMESPACE)


class OpenFaaSView(ListedSlots):
    """The :class:`~gateway_plugin.ports.Platform` of an OpenFaaS gateway, from its REST API (``refresh()``).

    A function's replicas are ``availableReplicas`` slots at ``<gateway>/function/<name>`` (OpenFaaS spreads
    them over its pods), or with ``pods`` (``QUART_PLATFORM=kubernetes``) its pods, called directly. What the gateway does not offer is declared here as such: no proxy queue of its
    own beside the plugin (``waiting`` 0), no placement to report (``check_placement``), scale from zero by
    the gateway itself (``scale_from_zero``), and a scale-down that cannot read sessions (``watch_*`` kept only)."""

    def __init__(self, gateway_url: str, auth: aiohttp.BasicAuth | None, pods: PodDirectory | None = None) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.auth = auth
        self.pods = pods  # QUART_PLATFORM=kubernetes: each stage's pods are its replicas (else gateway slots)
        self.status: dict[str, OpenFaaSFunction] = {}
        self.slots: dict[str, list[StaticReplica]] = {}
        self.waiters = Waiters()
        self.services: dict[str, ServiceTimes] = {}
        self.decisions: dict[str, str] = {}  # function -> the controller's last change and why
        self.kv_tokens: Callable[[str], int] | None = None
        self.demand: Callable[[str], GroupDemand] | None = None

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        async with session.get(f"{self.gateway_url}/system/functions", auth=self.auth) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET /system/functions answered {resp.status}: {(await resp.text())[:200]}")
            functions = await resp.json()
        self.status = {f["name"]: OpenFaaSFunction.from_status(f) for f in functions}
        for name, facts in self.status.items():
            have = self.slots.setdefault(name, [])
            url = f"{self.gateway_url}/function/{name}"
            while len(have) < facts.ready:
                have.append(StaticReplica(f"{name}#{len(have)}", url))
            while len(have) > facts.ready:  # drop idle slots first; busy ones finish and are then dropped
                idle = next((r for r in reversed(have) if r.in_flight == 0), None)
                if idle is None:
                    break
                have.remove(idle)
        for gone in set(self.slots) - set(self.status):
            del self.slots[gone]
        if self.pods is not None:
            await self.pods.follow({name: facts.namespace for name, facts in self.status.items()})
        self.waiters.wake()  # slots may have come

    # Platform: inventory

    def pipelines(self) -> dict[str, list[str]]:
        return vocab.pipelines((name, facts.labels) for name, facts in self.status.items())

    def function(self, name: str) -> OpenFaaSFunction | None:
        return self.status.get(name)

    # Platform: replicas and slots

    def ready(self, function: str) -> list[StaticReplica]:
        if self.pods is not None:
            return list(self.pods.ready(function))
        return list(self.slots.get(function, ()))

    # take, give_back, wait (woken at each release here and at each refresh), waiting (0: the plugin is the only
    # queue in front of the gateway's /function/<name>), service_times, note_held (kept on the slot): ListedSlots

    def mark_unreachable(self, function: str, replica: Replica) -> None:
        """A pod: no new calls till its slices change. A gateway slot stays (it is the gateway's ``/function/<name>``,
        which is up; its next refresh says what is)."""
        if self.pods is not None:
            self.pods.mark_unreachable(function, replica)

    def scale_from_zero(self, functions: Sequence[str]) -> None:
        """Nothing: the OpenFaaS gateway scales a function from zero at its own ``/function/<name>`` call."""

    # Platform: the controller's notes

    def note_decision(self, function: str, text: str) -> None:
        self.decisions[function] = text

    def check_placement(self, function: str) -> None:
        """Nothing to check: OpenFaaS places the pods (``availableReplicas`` short of ``replicas`` is the sign)."""

    # Platform: the session host

    def watch_sessions(self, kv_tokens: Callable[[str], int]) -> None:
        """Kept only: OpenFaaS's scale-down picks the pods it removes and cannot read sessions."""
        self.kv_tokens = kv_tokens

    def sessions_freed(self, replica_id: str) -> None:
        """Nothing: OpenFaaS drains no pod for its sessions (its scale-down cannot read them)."""

    def watch_demand(self, demand: Callable[[str], GroupDemand]) -> None:
        """Kept only: OpenFaaS runs no ParaServe groups."""
        self.demand = demand


class StandalonePlugin:
    """Router + controller + a small HTTP server in front of an OpenFaaS gateway."""

    def __init__(self, config: PluginConfig, password: str = "") -> None:
        if not config.gateway_url:
            raise ValueError("standalone mode needs the OpenFaaS gateway URL (--gateway or QUART_GATEWAY_URL)")
        if config.actuator == "gateway":
            config = replace(config, actuator="rest")
        self.config = config
        auth = aiohttp.BasicAuth(config.gateway_user, password) if password else None
        self.openfaas = OpenFaaSView(config.gateway_url, auth, pod_directory(config))
        self.view = GatewayView(self.openfaas, config.default_concurrency)  # the embedded gateway's reading of labels
        batching = self.view.batch_default = BatchLimits(config.batch_max, config.batch_wait_ms / 1000)
        self.collector = MetricsCollector(config.window_s)
        self.router = Router(self.view, self.view.pipelines, config, self.collector, self.view.stage_meta,
                             batch_limits=lambda fn: self.view.batch_limits(fn, batching))
        generation = GenerationConfig.from_env()
        self.engine = SessionEngine(self.view, generation,
                                    decode_limit=lambda fn: self.view.decode_batch_max(fn, generation.decode_batch_max),
                                    collector=self.collector)
        self.generation = GenerationAPI(self.engine, self.view.pipelines, self.view.model_dir, self.engine.config,
                                        self.collector, one_shot=self.router.answer)
        self.scaler = make_actuator(config, password=password)
        self.controller = Controller(self.view, self.router, self.collector, self.scaler, policy_factory(config), config,
                                     generation=self.engine, notes=self.view,
                                     compute_cores=max(0.0, config.compute_cores))  # auto: the cluster places pods
        self.openfaas.watch_sessions(self.engine.book.booked)
        self.engine.book.on_freed = self.openfaas.sessions_freed
        self.openfaas.watch_demand(self.engine.group_chains.demand)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = render_registry(self.collector.registry, request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _snapshot(self, request: web.Request) -> web.Response:
        return web.json_response({m: asdict(s) for m, s in self.controller.last_snapshots.items()},
                                 dumps=lambda d: json.dumps(d, default=str))

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/function/{model}", traced(self._invoke))
        app.router.add_route("*", "/v1/{tail:.*}", traced(self.generation.v1))
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/snapshot", self._snapshot)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/health", self._healthz)  # vLLM's path (GuideLLM checks it)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _invoke(self, request: web.Request) -> web.StreamResponse:
        """``POST /function/<model>[.<namespace>]`` (faas-cli adds the namespace): the model's pipeline, with the
        embedded gateway's tracing headers."""
        model, namespace = namespaces.split(request.match_info["model"])
        known = self.view.namespace_of(model)
        if namespace and known is not None and namespace != known:
            reply = json_reply(404, f"namespace {namespace!r} does not exist for pipeline {model!r} (it is in "
                                    f"{known!r})", "namespace")
            return web_response(reply)
        request = with_trace(request)
        return await self.generation.function(request, model) or await self.router.handle(request, model)

    async def _refresh_forever(self) -> None:
        assert self._session is not None
        while not self._stop.is_set():
            try:
                await self.openfaas.refresh(self._session)
            except Exception as exc:  # the gateway restarting must not stop the plugin
                log.warning("refreshing functions failed: %s", exc)
            await wait_event(self._stop, self.config.replica_refresh_s)

    async def _startup(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        await self.openfaas.refresh(self._session)
        await self.router.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._refresh_forever()), loop.create_task(self.controller.run(self._stop))]

    async def _cleanup(self, app: web.Application) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.router.close()
        await self.engine.close()
        if self.openfaas.pods is not None:
            await self.openfaas.pods.close()
        await self.scaler.close()
        if self._session is not None:
            await self._session.close()


def main(argv: list[str] | None = None) -> int:
    p = cliargs.ArgumentParser(prog="quartctl plugin", description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway", default=None, help="OpenFaaS gateway URL (QUART_GATEWAY_URL)")
    p.add_argument("--user", default=None, help="basic-auth user (QUART_GATEWAY_USER, default admin)")
    p.add_argument("--password-file", default=None, help="file holding the gateway password (mode 0600)")
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    args = p.parse_args(argv)
    cfg = PluginConfig.from_env()
    cfg = replace(cfg, gateway_url=args.gateway or cfg.gateway_url, gateway_user=args.user or cfg.gateway_user,
                  gateway_password_file=args.password_file or cfg.gateway_password_file)
    password = ""
    if cfg.gateway_password_file:
        with open(cfg.gateway_password_file) as fh:
            password = fh.read().strip()
    try:
        plugin = StandalonePlugin(cfg, password)
    except ValueError as exc:
        print(f"standalone plugin: {exc}", file=sys.stderr)
        return 2
    try:
        configure_logs()  # QUART_LOG_LEVEL, QUART_LOG_FORMAT (text or json)
    except ValueError as exc:  # ConfigError: the variable and what it must be
        print(f"quartctl plugin: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    web.run_app(plugin.app(), host=args.bind, port=args.port, print=lambda *a: None,
                loop=uvloop.new_event_loop())  # as quartctl up's gateway: the lean loop on the request path
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
