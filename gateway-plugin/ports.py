"""The plugin's ports: what it needs of a platform, as narrow typed interfaces (docs/contracts.md, "Ports").

The plugin reaches a platform only through these Protocols; each names every member it has, so an
implementation either has all of them or does not type-check (``make lint`` runs mypy, strict on this module),
and no caller probes for a member with ``hasattr`` / ``getattr`` (tests/unit/test_structure.py). A capability a
platform lacks is still a member: it answers that it has nothing (``waiting`` 0; ``scale_from_zero`` leaves it to
the platform's own; ``watch_sessions`` kept for nothing), and its docstring says so.

- :class:`Replica`: one replica the router and the session engine call (a live gateway endpoint, an OpenFaaS
  slot, a test's fixed URL).
- :class:`ReplicaSource`: a stage function's replicas and their slots: what the router and the session engine use.
- :class:`Platform`: what a platform offers the plugin, every member: its inventory (:meth:`Platform.pipelines`,
  :meth:`Platform.function`), its replicas and slots, the scaler's notes, and the session host
  (:class:`SessionWatch`). The embedded gateway (``quart_provider.gateway.EmbeddedGateway``) and the OpenFaaS view
  (``gateway_plugin.standalone.OpenFaaSView``) implement it; ``gateway_plugin.view.GatewayView`` reads labels over it
  and is the router's :class:`ReplicaSource` and the controller's ``Inventory``.
- :class:`Scaler`: how a decision reaches the platform (the actuators).
- :class:`PluginHost`: the embedded gateway's attach points (routes, hooks, metrics, shutdown), over its
  :class:`Platform`.

Protocols only: this module imports nothing of either platform (they never import each other).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from aiohttp import web
from prometheus_client.registry import Collector
from quart_kernel.admission import ServiceTimes
from quart_kernel.scheduling.paraserve_gen import GroupDemand
from quart_transport.responses import Answer

Range = tuple[int, int]  # a half-open layer range [A, B) (gateway_plugin.layers)


class Replica(Protocol):
    """A replica of a stage function: where to call it and what it holds. ``in_flight`` and ``held`` are the two
    fields its source updates (slots taken; the layers its answers say it holds)."""

    in_flight: int
    held: Range | None  # the layers it can run now (None: all of its stage)

    @property
    def id(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def layers(self) -> Range | None: ...  # its stage's layers, when reported (None: a whole replica)

    @property
    def part(self) -> Range | None: ...  # a ParaServe part: the layers it serves a group's sessions for

    @property
    def state(self) -> str: ...  # starting | ready | draining | dead (a fixed replica: ready)


class ReplicaSlots(Protocol):
    """A function's replicas and their slots, as the platform keeps them.

    ``ready``: the replicas that may take a call (parts and live replicas too); ``take`` / ``give_back``: one slot
    of a replica around each call; ``wait``: a future resolved when a slot may have freed or a replica became
    ready (the caller bounds its wait); ``waiting``: calls of the function waiting for a slot outside the plugin
    (the gateway's proxy; 0 where there is none); ``service_times``: the function's one service-time estimator
    (admission's p90); ``note_held``: the layers a replica's answer says it holds (``X-Quart-Layers-Held``);
    ``mark_unreachable``: nothing listens on the replica (routed nothing more until the platform says);
    ``scale_from_zero``: a call came for these functions (those at zero start now, or the platform's own
    scale from zero does it)."""

    def ready(self, function: str) -> Sequence[Replica]: ...

    def take(self, function: str, replica: Replica) -> None: ...

    def give_back(self, function: str, replica: Replica) -> None: ...

    def wait(self, function: str) -> asyncio.Future[None]: ...

    def waiting(self, function: str) -> int: ...

    def service_times(self, function: str) -> ServiceTimes: ...

    def note_held(self, function: str, replica: Replica, held: Range) -> None: ...

    def mark_unreachable(self, function: str, replica: Replica) -> None: ...

    def scale_from_zero(self, functions: Sequence[str]) -> None: ...


class ReplicaSource(ReplicaSlots, Protocol):
    """What the router and the session engine use: the platform's slots and each function's concurrency per
    replica (0: unlimited), the plugin's default where the function says none."""

    def concurrency(self, function: str) -> int: ...


class FunctionFacts(Protocol):
    """What the platform says of one function now (its deployment and its replica counts)."""

    @property
    def ready(self) -> int: ...

    @property
    def desired(self) -> int: ...

    @property
    def cpus(self) -> float: ...  # per replica; 0: not limited

    @property
    def min_replicas(self) -> int: ...

    @property
    def max_replicas(self) -> int: ...

    @property
    def concurrency(self) -> int: ...  # its com.quart.concurrency; 0: not set

    @property
    def labels(self) -> Mapping[str, str]: ...  # the same object while the deployment is unchanged

    @property
    def env(self) -> Mapping[str, str]: ...

    @property
    def start_s(self) -> float: ...  # ask → ready of its recent replicas; −1: unknown

    @property
    def namespace(self) -> str: ...


class DecisionNotes(Protocol):
    """What the controller tells the platform beside its scaling: ``note_decision`` (the function's lastDecision),
    ``check_placement`` (log, once per change, the replicas the platform cannot place and why)."""

    def note_decision(self, function: str, text: str) -> None: ...

    def check_placement(self, function: str) -> None: ...


class SessionWatch(Protocol):
    """The session host: the platform's scale-down reads the generation sessions. ``watch_sessions``: KV positions
    sessions hold on a replica (replica id → n; scale-down keeps and drains those); ``watch_demand``: a function's
    session demand (a whole ParaServe group keeps the workers it needs); ``sessions_freed``: sessions on a replica
    freed their KV positions (a drain waiting for them looks again at once)."""

    def watch_sessions(self, kv_tokens: Callable[[str], int]) -> None: ...

    def sessions_freed(self, replica_id: str) -> None: ...

    def watch_demand(self, demand: Callable[[str], GroupDemand]) -> None: ...


class Platform(ReplicaSlots, DecisionNotes, SessionWatch, Protocol):
    """Everything the plugin uses of a platform (embedded gateway, OpenFaaS): its pipelines (``com.quart.model``
    functions in stage order) and one function's facts (None: not deployed), plus the ports above."""

    def pipelines(self) -> dict[str, list[str]]: ...

    def function(self, name: str) -> FunctionFacts | None: ...


class Scaler(Protocol):
    """How a controller's decision reaches the platform (``gateway_plugin.actuators``)."""

    async def scale(self, function: str, replicas: int, key: bool = False) -> None: ...

    async def set_cpus(self, function: str, cpus: float) -> None: ...

    async def close(self) -> None: ...


InvokeHook = Callable[[web.Request, str, str], Awaitable[web.StreamResponse | None]]
ApiHook = Callable[[web.Request], Awaitable[web.StreamResponse | None]]
UiHook = Callable[[web.Request, str], Awaitable[web.StreamResponse]]
PipelineRoute = Callable[[str, str, str, Mapping[str, str], bytes], Awaitable[Answer]]


class GenerationRoute(Protocol):
    """Generation bodies on ``POST /function/<model>``: which pipelines generate, and the answer to a body."""

    def generates(self, model: str) -> bool: ...

    async def answer(self, request: web.Request, model: str, body: bytes) -> web.StreamResponse | None: ...


class PluginHost(Platform, Protocol):
    """The embedded gateway as the plugin attaches to it: its :class:`Platform`, the routes and hooks the plugin
    answers, its metrics, its shutdown, its own scaling calls, its basic auth, its invocation counters, and what
    the status page (``/ui/``) shows of its functions and hosts."""

    def add_invoke_hook(self, hook: InvokeHook) -> None: ...

    def add_api_hook(self, hook: ApiHook) -> None: ...

    def set_ui_hook(self, hook: UiHook) -> None: ...

    def route_pipelines(self, route: PipelineRoute) -> None: ...

    def route_generation(self, route: GenerationRoute) -> None: ...

    def reserve_name(self, name: str, owner: str) -> None: ...

    def on_shutdown(self, callback: Callable[[], Awaitable[None]]) -> None: ...

    def add_collector(self, collector: Collector) -> None: ...

    def authorised(self, authorization: str | None) -> bool: ...

    def record_invocation(self, name: str, code: int, seconds: float) -> None: ...

    async def scale_function(self, name: str, replicas: int, key: bool = False) -> None: ...

    async def set_function_cpus(self, name: str, cpus: float) -> None: ...

    def stage_status(self, name: str) -> dict[str, object] | None: ...  # the status page's row of a function

    def hosts_status(self) -> list[dict[str, object]]: ...  # the status page's hosts: name, GPU slots, used


__all__ = ["ApiHook", "DecisionNotes", "FunctionFacts", "GenerationRoute", "InvokeHook", "PipelineRoute", "Platform",
           "PluginHost", "Range", "Replica", "ReplicaSlots", "ReplicaSource", "Scaler", "SessionWatch", "UiHook"]
