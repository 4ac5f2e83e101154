"""A host backed by its KeysManager: each planned start is one call, which the KeysManager carries out.

Process runnables (the built-in echo) have no parameters to cache; they run as plain children of the
gateway, counted in the same host's slots.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from quart_kernel.scheduling.hosts import host_view_from_report
from quart_kernel.scheduling.types import HostView
from quart_provider.hosts import ProcessHost, ReplicaSpec, ReplicaStatus, Started, replica_cpus

from keysmanager.client import AsyncKeysManagerClient
from keysmanager.types import ReplicaInfo, StageSpec, StartOrder


def _status(info: ReplicaInfo) -> ReplicaStatus:
    layers, held = getattr(info, "layers", None), getattr(info, "layers_held", None)
    return ReplicaStatus(info.id, info.function, info.host, info.url, info.state, info.source, info.pid,
                         tuple(layers) if layers else None, tuple(held) if held else None)


def _stage(spec: ReplicaSpec) -> StageSpec:
    """The KeysManager's spec: CPUs are the function's CPU limit, else its ``QUART_THREADS`` (default 1)."""
    return StageSpec(function=spec.function, env=dict(spec.env), cpus=replica_cpus(spec),
                     memory_bytes=spec.memory_bytes or 0, concurrency=spec.concurrency or 1)


async def multicast(spec: ReplicaSpec, chain: Sequence[KeysManagerHost | None]) -> None:
    """Start a chain multicast (``quart_kernel.scheduling.multicast.plan_chain``'s order: the source, or None
    for the registry, then the receivers): each receiver fetches from its predecessor, which forwards every
    chunk as it writes it, falling back to the source and then the registry. Told in order, so each transfer
    is registered before the next host asks for its bytes; returns once all are told (starts then fork)."""
    source = chain[0].peer_address if chain and chain[0] is not None else None
    for prev, host in zip(chain, chain[1:], strict=False):
        peers = [a for a in (prev.peer_address if prev is not None else None, source) if a]
        await host.prefetch(spec, list(dict.fromkeys(peers)))


class KeysManagerHost:
    """One host: its KeysManager (a client on its Unix socket, or on TCP with the cluster token) plus a
    :class:`ProcessHost` for process runnables."""

    def __init__(self, name: str, client: AsyncKeysManagerClient, gpu_slots: int, memory_limit: int,
                 log_dir: Path | None = None, km_logs: Path | None = None) -> None:
        self.name = name
        self.client = client
        self.km_logs = km_logs  # the KeysManager's own logs folder (replica and zygote output), if readable here
        self._processes = ProcessHost(name, gpu_slots, memory_limit, log_dir=log_dir)

    async def report(self) -> HostView:
        km_replicas = await self.client.replicas(memory=False)
        view = host_view_from_report(await self.client.report(), km_replicas)
        extra = await self._processes.report()
        running = dict(view.running)
        for function, count in extra.running.items():
            running[function] = running.get(function, 0) + count
        return HostView(name=view.name, gpu_slots=view.gpu_slots, gpu_used=view.gpu_used + extra.gpu_used,
                        memory_limit=view.memory_limit, memory_used=view.memory_used, cached=view.cached, held=view.held,
                        running=running)

    @property
    def peer_address(self) -> str | None:
        """Where other KeysManagers fetch stage files from this host (its TCP address); None on a Unix socket."""
        return self.client.address if self.client.address.startswith("http://") else None

    async def prefetch(self, spec: ReplicaSpec, peers: Sequence[str] = ()) -> dict:
        """Start fetching a registry stage onto this host (from ``peers``, else the registry); answers at once."""
        return await self.client.prefetch(_stage(spec), peers)

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        """One planned start, one KeysManager call (``POST /v1/starts``, ``keysmanager.starts``): the host forks
        from its zygote, fetches from the order's peers (serving while the bytes arrive), or caches first, and
        says which. Replicas survive a KeysManager crash (its successor adopts them, and so does the gateway
        when the host is back), except live ones, whose file is still arriving. Process runnables run here."""
        if spec.kind == "process":
            return await self._processes.start(spec, order)
        if spec.secrets:  # the KeysManager starts a stage's replicas from one spec: no per-replica folder yet
            raise ValueError(f"{spec.function}: secrets are given to process replicas only, not yet to KeysManager "
                             "stage replicas")
        report = await self.client.start_planned(_stage(spec), order)
        return Started([_status(r) for r in report.replicas], report.path, report.fallback)

    async def pin(self, functions: list[str], sole: list[str] | None = None) -> list[str]:
        """Keep these stages' zygotes through LRU eviction (the scheduler's ``keep_cached`` for this host);
        ``sole``: the stages no other host holds, which its eviction drops after any duplicate."""
        return await self.client.pin(functions, sole)

    async def stop(self, replica_id: str) -> None:
        if replica_id.startswith(f"{self.name}-") and replica_id in {r.id for r in await self._processes.replicas()}:
            await self._processes.stop(replica_id)
            return
        await self.client.stop(replica_id, drain=True)

    async def resize(self, replica_id: str, cpus: float) -> None:
        if replica_id.startswith(f"{self.name}-") and replica_id in {r.id for r in await self._processes.replicas()}:
            await self._processes.resize(replica_id, cpus)
            return
        await self.client.resize(replica_id, cpus)

    async def replicas(self) -> list[ReplicaStatus]:
        stage = [_status(r) for r in await self.client.replicas(memory=False)]
        return stage + await self._processes.replicas()

    async def invalidate(self, function: str) -> None:
        await self.client.invalidate(function)

    async def log_files(self, function: str) -> list[tuple[str, Path]]:
        """Process replicas' logs, then the KeysManager's for the stage: a cold replica writes
        ``<rid>.log``; replicas forked from a zygote share its ``zygote-<function>-<n>.log``."""
        files = await self._processes.log_files(function)
        if self.km_logs is None or not self.km_logs.is_dir():
            return files
        for info in await self.client.replicas(memory=False):
            path = self.km_logs / f"{info.id}.log"
            if info.function == function and path.is_file():
                files.append((info.id, path))
        zygote = re.compile(rf"^zygote-{re.escape(function.replace('/', '_'))}-\d+\.log$")
        files += [(f"{self.name}-{p.stem}", p) for p in sorted(self.km_logs.iterdir()) if zygote.match(p.name)]
        return files

    async def close(self) -> None:
        await self._processes.close()
        await self.client.close()
