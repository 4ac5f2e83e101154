"""The provider's shared state types: a replica the gateway routes to, and one deployed function.

Like faas-provider's ``types`` package: the registry, the balancer and the reconciler all read and
write these; placement's own inputs (``ReplicaRequest``, ``HostView``) live in :mod:`quart_kernel.scheduling.types`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from quart_kernel.admission import ServiceTimes
from quart_kernel.replicaset import StartTimeEstimate
from quart_provider.deployment import FunctionDeployment
from quart_provider.hosts import ReplicaSpec
from quart_provider.images import Runnable
from quart_stage.privdrop import RUN_AS_ENV

InvokeHook = Callable[[Any, str, str], Awaitable[Any]]  # (aiohttp request, name, sub-path) → response | None
UiHook = Callable[[Any, str], Awaitable[Any]]  # (aiohttp request, path under /ui/) → response
# (model, method, sub-path, headers with the trace's, whole body) → its Answer (quart_transport.responses)
PipelineRoute = Callable[[str, str, str, Mapping[str, str], bytes], Awaitable[Any]]


class GenerationRoute(Protocol):
    """Generation on ``POST /function/<model>`` (the plugin's generation API): which pipelines can generate,
    and the answer to a body (a streamed aiohttp response, or None: a one-shot body for the pipeline route)."""

    def generates(self, model: str) -> bool: ...

    async def answer(self, request: Any, model: str, body: bytes) -> Any: ...


class ReplicaRef(Protocol):
    """A replica as the plugin hands it back (``gateway_plugin.ports.Replica``): one of this gateway's endpoints."""

    in_flight: int
    held: tuple[int, int] | None

    @property
    def id(self) -> str: ...


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
    layers: tuple[int, int] | None = None  # its stage's layers [S, E) when its host reports them
    held: tuple[int, int] | None = None  # the layers it can run now; short of ``layers`` while it loads (live)
    ready_ms: float | None = None  # placement asked -> ready (the reconciler's replica-ready hook), once ready
    partial_ok: bool = True  # routed while it holds part of its stage (a live start); else only once whole
    part: tuple[int, int] | None = None  # a ParaServe part start: the layers it serves first (generation chains)
    cpus: float = 0.0  # CPUs it runs with (its start's spec, then each in-place resize; 0: not limited)

    @property
    def whole(self) -> bool:
        """Runs its whole stage (a live replica still receiving parameters runs only the layers it holds)."""
        return self.layers is None or self.held is None or self.held == self.layers

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id, "function": self.function, "host": self.host, "url": self.url, "state": self.state,
               "source": self.source, "generation": self.generation, "inFlight": self.in_flight,
               "served": self.served, "readyMs": round(self.ready_ms, 1) if self.ready_ms is not None else None}
        if self.layers is not None:
            out.update(layers=list(self.layers), layersHeld=list(self.held or self.layers))
        return out


@dataclass(slots=True)
class FunctionState:
    """One deployed function: its spec, desired replicas, and the replicas it has."""

    deployment: FunctionDeployment
    runnable: Runnable
    desired: int
    created_at: datetime
    generation: int = 1
    replicas: dict[str, Endpoint] = field(default_factory=dict)
    ready: list[Endpoint] = field(default_factory=list)  # routing list: state == ready, whole stage held
    partial: list[Endpoint] = field(default_factory=list)  # ready, serving only the layers held so far (live)
    pending_starts: int = 0
    invocations: int = 0
    waiting: int = 0
    wakeups: list[asyncio.Future] = field(default_factory=list)
    unplaced: int = 0
    start_failures: int = 0  # consecutive failed replica starts (backoff)
    retry_at: float = 0.0  # monotonic time before which no new start is tried
    last_error: str = ""
    start_time: StartTimeEstimate = field(default_factory=StartTimeEstimate)  # ask → ready of recent replicas
    secrets_source: str = ""  # the secret store folder of the function's namespace
    service: ServiceTimes = field(default_factory=ServiceTimes)  # recent replica answer times (admission)
    admitted: int = 0  # proxied calls admitted and not yet answered (reading their body, waiting, served)
    run_as: int | None = None  # the uid (= gid) its replicas run as (GatewayConfig.replica_uids); None: the gateway's
    last_decision: str = ""  # the autoscaler's last change of ``desired`` and why (com.quart.last-decision)

    @property
    def name(self) -> str:
        return self.deployment.service

    @property
    def metric_name(self) -> str:
        return f"{self.deployment.service}.{self.deployment.namespace}"

    def refresh_ready(self) -> None:
        serving = [e for e in self.replicas.values() if e.state == "ready"]
        self.ready = [e for e in serving if e.whole]
        self.partial = [e for e in serving if not e.whole and e.partial_ok]
        self.wake()

    def add_waiter(self, future: asyncio.Future) -> None:
        """``future`` resolved at the next :meth:`wake` (a release, a ready-list change); futures whose
        waiters gave up are dropped as the list grows."""
        if len(self.wakeups) >= 16:
            self.wakeups[:] = [f for f in self.wakeups if not f.done()]
        self.wakeups.append(future)

    def wake(self) -> None:
        if self.wakeups:
            for fut in self.wakeups:
                if not fut.done():
                    fut.set_result(None)
            self.wakeups.clear()

    def replica_spec(self, max_body_bytes: int) -> ReplicaSpec:
        """What a host starts for this function (its generation changes when this does)."""
        dep = self.deployment
        env = {**dep.env_vars, **self.runnable.env}
        env.setdefault("QUART_MAX_BODY_BYTES", str(max_body_bytes))
        if self.run_as is not None:  # quart_stage.privdrop: the replica drops to it before serving
            env.update({RUN_AS_ENV: f"{self.run_as}:{self.run_as}", "HOME": f"/tmp/quart-home-{self.run_as}"})
        return ReplicaSpec(function=self.name, kind=self.runnable.kind, env=env, cpus=dep.cpus,
                           memory_bytes=dep.memory_bytes, concurrency=dep.concurrency, argv=self.runnable.argv,
                           health_path=self.runnable.health_path, param_cache=dep.param_cache,
                           secrets=tuple(dep.secrets), secrets_source=self.secrets_source)

    def status_json(self) -> dict[str, Any]:
        """A ``FunctionStatus`` (faas-provider types / spec.openapi.yml)."""
        out = self.deployment.to_json()
        out["invocationCount"] = self.invocations
        out["replicas"] = self.desired
        out["availableReplicas"] = len(self.ready)
        out["createdAt"] = self.created_at.isoformat().replace("+00:00", "Z")
        return out


class FunctionFacts:
    """What the plugin reads of one function (``gateway_plugin.ports.FunctionFacts``), read through to its state."""

    __slots__ = ("fn",)

    def __init__(self, fn: FunctionState) -> None:
        self.fn = fn

    @property
    def ready(self) -> int:
        return len(self.fn.ready)

    @property
    def desired(self) -> int:
        return self.fn.desired

    @property
    def cpus(self) -> float:
        return self.fn.deployment.cpus or 0.0

    @property
    def min_replicas(self) -> int:
        return self.fn.deployment.min_replicas

    @property
    def max_replicas(self) -> int:
        return self.fn.deployment.max_replicas

    @property
    def concurrency(self) -> int:
        return self.fn.deployment.concurrency

    @property
    def labels(self) -> Mapping[str, str]:
        return self.fn.deployment.labels

    @property
    def env(self) -> Mapping[str, str]:
        return self.fn.deployment.env_vars

    @property
    def start_s(self) -> float:
        return self.fn.start_time.seconds

    @property
    def namespace(self) -> str:
        return self.fn.deployment.namespace
