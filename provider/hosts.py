"""Where replicas run: the host interface the gateway drives, and a host that runs plain processes.

A *host* is one (simulated) machine with replica slots ("GPUs") and parameter-cache memory. The
gateway asks a host to start or stop replicas and polls what runs there; it routes only to replicas
the host reports ``ready``. Two implementations:

- :class:`ProcessHost` (here): runs a runnable's command as a child process that inherits a listening
  socket, checks its health path until it answers 200. Used for process runnables (the built-in
  echo function) and in tests, with real processes.
- :class:`quart_provider.keysmanager_host.KeysManagerHost`: stage functions through the
  host's KeysManager (fork from a cached zygote, or cold start).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import resource
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import aiohttp
from quart_kernel.scheduling.types import HostView
from quart_provider.secrets import SECRETS_DIR_ENV, mount, unmount
from quart_stage.envpolicy import replica_base_env
from quart_stage.privdrop import RUN_AS_ENV, drop_privileges, parse_run_as

from keysmanager.aio import within
from keysmanager.sysutil import set_parent_death_signal, set_process_cores
from keysmanager.types import StartOrder

ReplicaState = Literal["starting", "ready", "draining", "dead"]
LISTEN_FD_ENV = "QUART_LISTEN_FD"  # a process runnable serves HTTP on this inherited socket


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What a host needs to start replicas of one function (the KeysManager's ``StageSpec`` plus kind)."""

    function: str
    kind: Literal["stage", "process"]
    env: dict[str, str] = field(default_factory=dict)
    cpus: float | None = None
    memory_bytes: int | None = None
    concurrency: int = 0
    argv: tuple[str, ...] = ()  # process runnables: the command
    health_path: str = "/_/health"
    # False: cold-start every replica (no KeysManager cache). Not part of what a replica runs, so changing it
    # restarts nothing: it applies to the replicas started from then on.
    param_cache: bool = field(default=True, compare=False)
    secrets: tuple[str, ...] = ()  # names, given to each replica as files (:mod:`quart_provider.secrets`)
    secrets_source: str = field(default="", compare=False)  # the namespace's secret store folder


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica as its host reports it (the KeysManager's ``ReplicaInfo``)."""

    id: str
    function: str
    host: str
    url: str
    state: ReplicaState
    source: str = "cold"  # fork | cold
    pid: int = 0
    layers: tuple[int, int] | None = None  # its stage's layers [S, E), when the host reports them
    held: tuple[int, int] | None = None  # the layers it can run now (a live replica's grow as they arrive)


@dataclass(frozen=True, slots=True)
class Started:
    """What a host did with one start order (the KeysManager's ``StartReport``): the replicas, still starting
    (the gateway's probe routes them), the path taken (``keysmanager.types.StartPath``) and, when that is not
    the plan's mode, why."""

    replicas: list[ReplicaStatus]
    path: str
    fallback: str = ""


class Host(Protocol):
    """One host the gateway places replicas on."""

    name: str

    async def report(self) -> HostView: ...

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started: ...  # one planned start, one call

    async def stop(self, replica_id: str) -> None: ...

    async def resize(self, replica_id: str, cpus: float) -> None: ...  # in place: its cores (quart_kernel.resize)

    async def replicas(self) -> list[ReplicaStatus]: ...

    async def invalidate(self, function: str) -> None: ...

    async def log_files(self, function: str) -> list[tuple[str, Path]]: ...  # (instance, file) of its replicas

    async def close(self) -> None: ...


def replica_cpus(spec: ReplicaSpec) -> float:
    """The CPUs a replica of ``spec`` runs with: its function's CPU limit, else a stage's ``QUART_THREADS``
    (default 1; the KeysManager's), else 0 (a process without a limit: not managed)."""
    if spec.cpus:
        return spec.cpus
    raw = spec.env.get("QUART_THREADS", "")
    if spec.kind == "stage":
        return float(raw) if raw.isdigit() and int(raw) > 0 else 1.0
    return 0.0


async def poll_replicas(hosts: dict[str, Host], timeout_s: float) -> dict[str, list[ReplicaStatus] | BaseException]:
    """Every host's replicas at once, each bounded by ``timeout_s``; a host that fails or is slow maps to its error.
    Each poll's coroutine is made inside its own task, so a pass cancelled at shutdown leaves none un-awaited."""
    async def one(host: Host) -> list[ReplicaStatus]:
        return await within(timeout_s, host.replicas())

    names = list(hosts)
    found = await asyncio.gather(*(one(hosts[n]) for n in names), return_exceptions=True)
    return dict(zip(names, found, strict=True))


def cpu_set(cpus: float | None, offset: int) -> set[int] | None:
    """The cores a replica limited to ``cpus`` may use (round-robin by ``offset``); None = all."""
    if not cpus:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    count = min(len(allowed), max(1, math.ceil(cpus)))
    return {allowed[(offset + i) % len(allowed)] for i in range(count)}


def thread_env(cpus: float | None) -> dict[str, str]:
    """Thread-pool sizes for a replica with ``cpus`` CPUs (torch/OpenMP read these)."""
    if not cpus:
        return {}
    threads = str(max(1, math.ceil(cpus)))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "QUART_THREADS": threads}


@dataclass(slots=True)
class _Child:
    status: ReplicaStatus
    process: asyncio.subprocess.Process
    health_task: asyncio.Task | None = None
    secrets: Path | None = None  # this replica's copy of its function's secrets


class ProcessHost:
    """A simulated host that runs process runnables as children with an inherited listening socket.

    Limits: ``cpus`` → CPU affinity (``sched_setaffinity``) and thread-pool variables;
    ``memory_bytes`` → ``RLIMIT_AS`` of the child (its address space), so an over-allocating replica
    fails instead of starving its neighbours. With ``log_dir``, a replica's stdout and stderr go to
    ``<log_dir>/<function>/<replica>.log`` (``/system/logs`` reads them); else they are the gateway's.
    """

    kinds = frozenset({"process"})  # runnables it can start (quart_kernel.capacity)

    def __init__(self, name: str, gpu_slots: int, memory_limit: int, health_interval_s: float = 0.02,
                 log_dir: Path | None = None) -> None:
        self.name = name
        self.log_dir = log_dir
        self.gpu_slots = gpu_slots
        self.memory_limit = memory_limit
        self._children: dict[str, _Child] = {}
        self._ids = itertools.count(1)
        self._health_interval_s = health_interval_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        return self._session

    async def report(self) -> HostView:
        running = Counter(c.status.function for c in self._children.values() if c.status.state != "dead")
        return HostView(name=self.name, gpu_slots=self.gpu_slots, gpu_used=sum(running.values()),
                        memory_limit=self.memory_limit, memory_used=0, running=dict(running))

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        """Start ``order.count`` processes: each loads on its own (``cold``; a process has no parameters to fork
        or fetch, so the plan's peers and layers do not apply)."""
        if spec.kind != "process" or not spec.argv:
            raise ValueError(f"host {self.name} runs only process runnables, not {spec.kind!r} ({spec.function})")
        started = [await self._start_one(spec) for _ in range(order.count)]
        return Started(started, "cold", "" if order.mode == "cold" else "a process runnable has no parameters")

    async def _start_one(self, spec: ReplicaSpec) -> ReplicaStatus:
        number = next(self._ids)
        replica_id = f"{self.name}-{spec.function}-{number}"
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        env = {**replica_base_env(os.environ), **spec.env, **thread_env(spec.cpus), LISTEN_FD_ENV: str(sock.fileno())}
        run_as = parse_run_as(env[RUN_AS_ENV]) if env.get(RUN_AS_ENV) else None
        secrets = mount(Path(spec.secrets_source), spec.secrets, replica_id, run_as) if spec.secrets else None
        if secrets is not None:
            env[SECRETS_DIR_ENV] = str(secrets)
        cores = cpu_set(spec.cpus, number)
        memory = spec.memory_bytes

        def limit_child() -> None:  # runs in the child between fork and exec
            set_parent_death_signal()
            if cores:
                os.sched_setaffinity(0, cores)
            if memory:
                resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            if run_as is not None:  # last: the function's own uid, for good (quart_stage.privdrop)
                drop_privileges(*run_as)

        log = None
        if self.log_dir is not None:
            (self.log_dir / spec.function).mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / spec.function / f"{replica_id}.log", "ab")  # noqa: SIM115 - the child's
        try:
            process = await asyncio.create_subprocess_exec(
                *spec.argv, env=env, pass_fds=(sock.fileno(),), preexec_fn=limit_child,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True, stdout=log,
                stderr=asyncio.subprocess.STDOUT if log else None,
            )
        except BaseException:
            unmount(secrets)
            raise
        finally:
            sock.close()
            if log is not None:
                log.close()
        status = ReplicaStatus(replica_id, spec.function, self.name, f"http://127.0.0.1:{port}", "starting",
                               "cold", process.pid)
        child = _Child(status, process, secrets=secrets)
        self._children[replica_id] = child
        child.health_task = asyncio.create_task(self._await_ready(child, spec.health_path))
        return status

    async def _await_ready(self, child: _Child, health_path: str) -> None:
        url = child.status.url + health_path
        while child.process.returncode is None and child.status.state == "starting":
            try:
                async with self._http().get(url) as resp:
                    if resp.status == 200:
                        child.status = _with_state(child.status, "ready")
                        return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(self._health_interval_s)

    async def resize(self, replica_id: str, cpus: float) -> None:
        """An in-place CPU change: the child's threads get ``cpus`` cores (round robin by its number, as at start)."""
        child = self._children.get(replica_id)
        if child is None or child.process.returncode is not None:
            raise LookupError(f"host {self.name} runs no replica {replica_id!r}")
        cores = cpu_set(cpus, int(replica_id.rsplit("-", 1)[1]))
        if cores:
            set_process_cores(child.process.pid, sorted(cores))

    async def stop(self, replica_id: str) -> None:
        child = self._children.pop(replica_id, None)
        if child is None:
            return
        if child.health_task:
            child.health_task.cancel()
        await _terminate(child.process)
        unmount(child.secrets)

    async def replicas(self) -> list[ReplicaStatus]:
        for child in self._children.values():
            if child.process.returncode is not None and child.status.state != "dead":
                child.status = _with_state(child.status, "dead")
        statuses = [c.status for c in self._children.values()]
        for replica_id in [k for k, c in self._children.items() if c.status.state == "dead"]:
            unmount(self._children.pop(replica_id).secrets)  # reported dead once, then forgotten
        return statuses

    async def invalidate(self, function: str) -> None:
        """Process runnables keep no cached parameters: nothing to drop."""

    async def log_files(self, function: str) -> list[tuple[str, Path]]:
        """The log file of every replica of ``function`` this host started (stopped ones included)."""
        folder = self.log_dir / function if self.log_dir is not None else None
        if folder is None or not folder.is_dir():
            return []
        return [(p.stem, p) for p in sorted(folder.glob("*.log"))]

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(k) for k in list(self._children)))
        if self._session is not None:
            await self._session.close()


def _with_state(status: ReplicaStatus, state: ReplicaState) -> ReplicaStatus:
    return ReplicaStatus(status.id, status.function, status.host, status.url, state, status.source, status.pid)


async def _terminate(process: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    """SIGTERM the child (and its process group), then SIGKILL after ``grace_s``; always reaps it."""
    if process.returncode is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while process.returncode is None and time.monotonic() < deadline:
            try:
                await within(max(0.01, deadline - time.monotonic()), process.wait())
            except TimeoutError:
                break
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    await process.wait()
