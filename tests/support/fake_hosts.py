"""Fake hosts for the embedded gateway core: replicas that start and stop on command, no processes."""

from __future__ import annotations

import asyncio

from quart_kernel.scheduling.types import HostView
from quart_provider.config import GatewayConfig
from quart_provider.deployment import FunctionDeployment
from quart_provider.gateway import EmbeddedGateway
from quart_provider.hosts import ReplicaSpec, ReplicaStatus, Started

from keysmanager.types import StartOrder


class FakeHost:
    """A host whose replicas become ready only when the test says so."""

    def __init__(self, name: str, slots: int = 4) -> None:
        self.name, self.slots = name, slots
        self.replicas_: dict[str, ReplicaStatus] = {}
        self.started: list[ReplicaSpec] = []
        self.orders: list[StartOrder] = []  # each start's plan, as the gateway handed it over
        self.stopped: list[str] = []
        self.invalidated: list[str] = []
        self.resized: list[tuple[str, float]] = []  # (replica, cpus) of each in-place resize
        self.n = 0

    async def report(self) -> HostView:
        live = [r for r in self.replicas_.values() if r.state != "dead"]
        return HostView(name=self.name, gpu_slots=self.slots, gpu_used=len(live), memory_limit=1 << 30, memory_used=0)

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        """Start as planned (a fake host has nothing to fall back from)."""
        self.orders.append(order)
        return Started(self.start_n(spec, order.count), "fork" if order.mode == "gpu" else order.mode)

    def start_n(self, spec: ReplicaSpec, count: int) -> list[ReplicaStatus]:
        out = []
        for _ in range(count):
            self.n += 1
            status = ReplicaStatus(f"{self.name}-{spec.function}-{self.n}", spec.function, self.name,
                                   f"http://127.0.0.1:1/{self.n}", "starting")
            self.replicas_[status.id] = status
            self.started.append(spec)
            out.append(status)
        return out

    def make_ready(self) -> None:
        for key, r in self.replicas_.items():
            if r.state == "starting":
                self.replicas_[key] = ReplicaStatus(r.id, r.function, r.host, r.url, "ready")

    async def stop(self, replica_id: str) -> None:
        self.stopped.append(replica_id)
        self.replicas_.pop(replica_id, None)

    async def resize(self, replica_id: str, cpus: float) -> None:
        if replica_id not in self.replicas_:
            raise LookupError(f"no replica {replica_id!r}")
        self.resized.append((replica_id, cpus))

    async def replicas(self) -> list[ReplicaStatus]:
        return list(self.replicas_.values())

    async def invalidate(self, function: str) -> None:
        self.invalidated.append(function)

    async def close(self) -> None:
        pass



def dep(name: str = "f", **labels: str) -> FunctionDeployment:
    body = {"service": name, "image": "quart/echo", "labels": labels, "limits": {"cpu": "2", "memory": "1Gi"},
            "envVars": {"K": "v"}}
    return FunctionDeployment.from_json(body, "openfaas-fn")



def make(tmp_path, hosts, **cfg) -> EmbeddedGateway:
    config = GatewayConfig(state_dir=tmp_path, reconcile_interval_s=0.01, ready_wait_s=0.3, drain_timeout_s=0.2, **cfg)
    return EmbeddedGateway(config, hosts)



async def settle(gw: EmbeddedGateway, rounds: int = 3) -> None:
    for _ in range(rounds):
        await gw.reconciler.reconcile()
        await asyncio.sleep(0.01)



class FlakyHost(FakeHost):
    """A host that behaves as a KeysManager does under load: polls can go unanswered (``silent``), starts can
    hang (``hold_starts``) and then finish on the host even when the gateway gave up on them (a cancelled
    client call does not cancel the host's work), a start can fail, and its slots are what runs there."""

    def __init__(self, name: str, slots: int = 4) -> None:
        super().__init__(name, slots)
        self.silent = False  # polls and reports fail (a missed health poll, a partition)
        self.failing = False  # starts fail (a fork that breaks)
        self.gate = asyncio.Event()  # starts wait for it (cleared: they hang)
        self.gate.set()
        self._work: set[asyncio.Task] = set()

    def hold_starts(self) -> None:
        self.gate.clear()

    def release_starts(self) -> None:
        self.gate.set()

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        work = asyncio.ensure_future(self._start_on_host(spec, order))
        self._work.add(work)
        work.add_done_callback(self._work.discard)
        return await asyncio.shield(work)  # the gateway may stop waiting; the host goes on

    async def _start_on_host(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        await self.gate.wait()
        if self.failing:
            raise RuntimeError(f"host {self.name}: start of {spec.function} failed")
        return await super().start(spec, order)

    async def settle(self) -> None:
        """Let the starts the host is still working on finish."""
        if self._work:
            await asyncio.gather(*self._work, return_exceptions=True)

    async def report(self) -> HostView:
        if self.silent:
            raise TimeoutError(f"host {self.name} does not answer")
        return await super().report()

    async def replicas(self) -> list[ReplicaStatus]:
        if self.silent:
            raise TimeoutError(f"host {self.name} does not answer")
        return await super().replicas()

    def live_ids(self) -> set[str]:
        return {r.id for r in self.replicas_.values() if r.state != "dead"}
