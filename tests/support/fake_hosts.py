"""Fake hosts for the embedded gateway core: replicas that start and stop on command, no processes."""

from __future__ import annotations

import asyncio

from quart_kernel.scheduling.types import HostView
from quart_provider.config import GatewayConfig
from quart_provider.deployment import FunctionDeployment
from quart_provider.gateway import EmbeddedGateway
from quart_provider.hosts import ReplicaSpec, ReplicaStatus


class FakeHost:
    """A host whose replicas become ready only when the test says so."""

    def __init__(self, name: str, slots: int = 4) -> None:
        self.name, self.slots = name, slots
        self.replicas_: dict[str, ReplicaStatus] = {}
        self.started: list[ReplicaSpec] = []
        self.stopped: list[str] = []
        self.invalidated: list[str] = []
        self.resized: list[tuple[str, float]] = []  # (replica, cpus) of each in-place resize
        self.n = 0

    async def report(self) -> HostView:
        live = [r for r in self.replicas_.values() if r.state != "dead"]
        return HostView(name=self.name, gpu_slots=self.slots, gpu_used=len(live), memory_limit=1 << 30, memory_used=0)

    async def start(self, spec: ReplicaSpec, count: int) -> list[ReplicaStatus]:
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

