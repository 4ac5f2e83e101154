"""The gateway side of ``quartctl bench blitzscale`` (both workloads): the stage function's deployment, and the
embedded gateway serving it from one replica on ``h0``, scaled up in one of the bench's modes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from quart_tools.bench import wait_until
from quart_tools.bench.blitz import MODEL_URL, TOKEN, PeerCluster
from quart_tools.bench.start_phases import StartPhases

FUNCTION = "blitzscale-stage-0"


def deployment(namespace: str, service_ms: float, replicas: int, env: dict[str, str] | None = None,
               concurrency: int = 1):
    """The bench's one stage function (emulated compute; ``env``: more of the stage's settings)."""
    from quart_provider.deployment import FunctionDeployment

    return FunctionDeployment.from_json({
        "service": FUNCTION, "image": "quart/pipeline-stage",
        "envVars": {"QUART_MODEL_URL": MODEL_URL, "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": "emulated",
                    "QUART_EMULATED_MEAN_MS": str(service_ms), "QUART_EMULATED_CV": "0", **(env or {})},
        "labels": {"com.quart.model": "blitzscale", "com.quart.stage": "0", "com.quart.stages": "1",
                   "com.quart.concurrency": str(concurrency), "com.openfaas.scale.min": str(replicas),
                   "com.openfaas.scale.max": "8"}}, namespace)


@dataclass
class Scaled:
    """A gateway serving the stage from one replica on ``h0`` (``first``), ready to be scaled up in ``mode``."""

    gw: Any
    view: Any
    fn: Any
    first: str
    phases: StartPhases
    km_hosts: list
    new: int
    taken: dict[str, float] = field(default_factory=dict)  # replica id -> when it was first given a call

    async def scale_up(self) -> float:
        """Ask for the new replicas now; the scale-up's t0."""
        self.taken.clear()
        self.phases.start()
        await self.gw.registry.scale(FUNCTION, 1 + self.new)
        return self.phases.t0

    async def whole(self) -> float:
        """When every new replica serves the whole stage."""
        return await wait_until(lambda: sum(e.id != self.first for e in self.fn.ready) >= self.new, 600,
                                "the new replicas")

    def first_served_ms(self) -> float | None:
        served = [at for rid, at in self.taken.items() if rid != self.first]
        return round(1000 * (min(served) - self.phases.t0), 1) if served else None

    async def row(self) -> dict[str, Any]:
        """The new replicas' sources and each one's start phases."""
        return {"sources": sorted({e.source for e in self.fn.replicas.values() if e.id != self.first}),
                "phases": {**self.phases.summary(),
                           "hosts": await self.phases.rows(self.km_hosts, FUNCTION, {self.first})}}


@contextlib.asynccontextmanager
async def scaled_gateway(cluster: PeerCluster, hosts: list[str], mode: str, dep) -> AsyncIterator[Scaled]:
    """The embedded gateway (reconciler, placer) over the hosts, configured for ``mode``, serving ``dep`` from one
    replica on ``h0`` (for ``allcache`` the first receiver holds the stage too); closed at the end."""
    from gateway_plugin.plugin import GatewayView
    from quart_kernel.scheduling import make_placer
    from quart_provider.config import GatewayConfig
    from quart_provider.gateway import EmbeddedGateway
    from quart_provider.keysmanager_host import KeysManagerHost

    from keysmanager.client import AsyncKeysManagerClient
    from keysmanager.types import StageSpec

    config = GatewayConfig(port=0, state_dir=cluster.work / f"gw-{mode}-{time.monotonic_ns()}",
                           reconcile_interval_s=0.05, host_timeout_s=3.0, host_down_after_s=30.0,
                           peer_fetch=mode != "registry-cold", live_scaling=mode == "live", ready_probe_s=0.002)
    km_hosts = [KeysManagerHost(h, AsyncKeysManagerClient(cluster.url(h), token=TOKEN, timeout=120), 1, 64 << 30)
                for h in hosts]
    gw = EmbeddedGateway(config, km_hosts, make_placer("first-fit"))
    await gw.start()
    try:
        view = GatewayView(gw)
        phases = StartPhases()
        phases.wrap(gw.reconciler, km_hosts)
        await gw.registry.deploy(dep)
        fn = gw.functions[FUNCTION]
        await wait_until(lambda: len(fn.ready) == 1, 300, "the first replica")
        [first] = [e.id for e in fn.ready]  # on h0, which now holds the stage: the peers' source
        if mode == "allcache":  # the receiver holds it too: its start is a fork
            stage = StageSpec(FUNCTION, env=dict(gw.reconciler._spec(fn).env))
            await km_hosts[1].client.ensure_cached(stage, [cluster.url("h0")])
        scaled = Scaled(gw, view, fn, first, phases, km_hosts, 4 if mode == "multicast-4" else 1)
        inner_take = view.take

        def take(function: str, replica) -> None:  # the first call each replica starts
            scaled.taken.setdefault(replica.id, time.monotonic())
            inner_take(function, replica)

        view.take = take
        yield scaled
    finally:
        await gw.close()


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank, as every row of this bench reports it), ms rounded."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)
