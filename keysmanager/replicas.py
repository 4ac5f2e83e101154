"""The replicas: forked from a zygote or cold-started, their GPU slots and cores, readiness, stop and death.

A replica is dead once reaped (our child, or an orphan re-parented to us: we are a subreaper), once its
zygote reports its exit, or, for those neither can report (adopted after a restart), once it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
from quart_stage.envpolicy import replica_base_env

from keysmanager import sysutil
from keysmanager.aio import within
from keysmanager.config import KeysManagerConfig
from keysmanager.errors import NoFreeSlot, NotFound, StartFailed
from keysmanager.launcher import Launcher
from keysmanager.records import Replica, Segments, Zygote
from keysmanager.stage import StageRef
from keysmanager.sysutil import listen_socket
from keysmanager.types import StageSpec
from keysmanager.zygotes import Zygotes

DEAD_KEPT = 256  # dead replicas kept in listings (so a crash is reported, not just gone)


class Replicas:
    """Every replica of this host by id (live, and the last ``DEAD_KEPT`` dead). ``open()`` before use."""

    def __init__(self, config: KeysManagerConfig, launcher: Launcher, segments: Segments,
                 changed: Callable[[], None]) -> None:
        self.config = config
        self.launcher = launcher
        self.segments = segments
        self.by_id: dict[str, Replica] = {}
        self._reserved: set[int] = set()  # slots of starts under way (their replica not recorded yet)
        self._changed = changed  # the state file must be rewritten
        self._cores = sorted(os.sched_getaffinity(0))
        self._next_core = 0
        self._http: aiohttp.ClientSession | None = None

    def open(self) -> None:
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))

    async def close(self) -> None:
        if self._http:
            await self._http.close()

    def live(self, function: str | None = None) -> list[Replica]:
        return [r for r in self.by_id.values() if r.state != "dead" and function in (None, r.function)]

    def adopt(self, rep: Replica) -> None:
        """A replica a previous KeysManager left running (told to survive)."""
        self.by_id[rep.id] = rep

    # ---------------------------------------------------------------- resources
    @property
    def slots_used(self) -> set[int]:
        """The GPU slots taken: those of live replicas, and those held for starts under way. Derived, never
        counted up and down, so a start that fails half-way or a death seen twice cannot leave a slot taken."""
        live = {r.gpu_slot for r in self.by_id.values() if r.state != "dead" and r.gpu_slot is not None}
        return live | self._reserved

    def check_free_slots(self, count: int) -> None:
        free = self.config.gpus - len(self.slots_used)
        if self.config.gpus and count > free:
            raise NoFreeSlot(f"host {self.config.name} has {free} free GPU slots; asked for {count}", "count")

    @contextlib.contextmanager
    def _slot(self) -> Iterator[int | None]:
        """A free slot (None on a CPU host), held for one start until its replica is recorded (it holds the slot
        from then on) or the start fails (the slot is free again)."""
        if self.config.gpus == 0:
            yield None
            return
        used = self.slots_used
        slot = next((s for s in range(self.config.gpus) if s not in used), None)
        if slot is None:
            raise NoFreeSlot(f"host {self.config.name} has no free GPU slot ({self.config.gpus} in use)", "count")
        self._reserved.add(slot)
        try:
            yield slot
        finally:
            self._reserved.discard(slot)

    def _take_cores(self, cpus: float) -> list[int]:
        return self._next_cores(cpus) if self.config.pin_cpus else []

    def _next_cores(self, cpus: float) -> list[int]:
        """⌈cpus⌉ cores (at most this host's), round robin over the host's cores."""
        n = min(len(self._cores), max(1, math.ceil(cpus)))
        cores = [self._cores[(self._next_core + i) % len(self._cores)] for i in range(n)]
        self._next_core = (self._next_core + n) % len(self._cores)
        return cores

    def _env(self, spec: StageSpec, slot: int | None) -> dict[str, str]:
        env = {"QUART_REPLICA_HOST": self.config.name}
        if slot is not None and spec.env.get("QUART_COMPUTE") == "cuda" and "CUDA_VISIBLE_DEVICES" not in spec.env:
            env["CUDA_VISIBLE_DEVICES"] = str(slot)  # the device decides where prepare_device copies parameters
        return env

    # ---------------------------------------------------------------- starting
    def unix_path(self, rid: str) -> str:
        """Where replica ``rid`` started with listen=unix serves (``replica_socket_path``), its folder made."""
        path = replica_socket_path(self.config.socket_path, rid)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        return str(path)

    async def fork(self, zygotes: Zygotes, z: Zygote, spec: StageSpec, mode: str, survive: bool,
                   requested_at: float, unix: bool = False) -> Replica:
        with self._slot() as slot:
            return await self._fork(zygotes, z, spec, mode, survive, requested_at, unix, slot)

    async def _fork(self, zygotes: Zygotes, z: Zygote, spec: StageSpec, mode: str, survive: bool,
                    requested_at: float, unix: bool, slot: int | None) -> Replica:
        cores = self._take_cores(spec.cpus)
        rid = f"{spec.function}-{uuid.uuid4().hex[:8]}"
        path = self.unix_path(rid) if unix else None
        answer = await zygotes.fork(z, {"replica_id": rid, "mode": mode, "survive": survive, "unix": path,
                                        "host": self.config.host_address,
                                        "env": self._env(spec, slot), "cores": cores, "threads": threads_of(spec)})
        if answer.get("op") != "forked":
            raise StartFailed(f"fork of {spec.function!r} failed: {answer.get('error')}", "spec")
        rep = Replica(rid, spec.function, int(answer["pid"]), int(answer["port"]), "fork", mode, survive,
                      requested_at, slot, cores, segment=z.segment, param_bytes=z.segment.nbytes, socket=path)
        rep.create_time = sysutil.create_time(rep.pid)
        z.segment.users.add(rid)
        self.by_id[rid] = rep
        return rep

    def spawn_cold(self, spec: StageSpec, stage: StageRef, mode: str, survive: bool, requested_at: float,
                   unix: bool = False) -> Replica:
        with self._slot() as slot:
            return self._spawn_cold(spec, stage, mode, survive, requested_at, unix, slot)

    def _spawn_cold(self, spec: StageSpec, stage: StageRef, mode: str, survive: bool, requested_at: float,
                    unix: bool, slot: int | None) -> Replica:
        cores = self._take_cores(spec.cpus)
        rid = f"{spec.function}-{uuid.uuid4().hex[:8]}"
        path = self.unix_path(rid) if unix else None
        listen = listen_socket(self.config.host_address, path)
        port = 0 if path else listen.getsockname()[1]
        env = {**replica_base_env(os.environ), **spec.env, **self._env(spec, slot), "PYTHONUNBUFFERED": "1"}
        args = ["--cold", "--listen-fd", str(listen.fileno()), "--threads", str(threads_of(spec)),
                "--cores", ",".join(map(str, cores))] + (["--survive"] if survive else [])
        try:
            proc = self.launcher.popen(args, env, self.config.state_path / "logs" / f"{rid}.log", (listen.fileno(),))
        finally:
            listen.close()  # the child holds the socket now: no port stays open behind it
        rep = Replica(rid, spec.function, proc.pid, port, "cold", mode, survive, requested_at, slot, cores,
                      proc=proc, param_bytes=stage.param_bytes, socket=path)
        rep.create_time = sysutil.create_time(proc.pid)
        self.by_id[rid] = rep
        return rep

    async def await_ready(self, rep: Replica) -> None:
        """Healthy once ``GET /_/health`` answers 200 (the request waits in the listen backlog until then)."""
        assert self._http is not None
        deadline = rep.requested_at + self.config.ready_timeout_s
        url = f"http://{self.config.host_address}:{rep.port}/_/health"
        session = self._http
        if rep.socket:  # served on a Unix socket: one session over it for the polls
            url = "http://localhost/_/health"
            session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=rep.socket, force_close=True))
        try:
            await self._poll_ready(rep, session, url, deadline)
        finally:
            if session is not self._http:
                await session.close()

    async def _poll_ready(self, rep: Replica, session: aiohttp.ClientSession, url: str, deadline: float) -> None:
        while rep.state == "starting":
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.signal(rep, signal.SIGKILL)
                return
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=remaining)) as resp:
                    if resp.status == 200 and rep.state == "starting":
                        rep.ready_ms = (time.monotonic() - rep.requested_at) * 1e3
                        rep.phases["ready"] = time.monotonic()
                        rep.state = "ready"
                        self._changed()
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.005)

    # ---------------------------------------------------------------- stopping
    def signal(self, rep: Replica, sig: int) -> None:
        if rep.state == "dead":
            return
        if rep.adopted and not sysutil.is_running(rep.pid, rep.create_time):
            self.mark_dead(rep, None)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(rep.pid, sig)

    async def stop(self, rid: str, drain: bool) -> Replica:
        rep = self.by_id.get(rid)
        if rep is None:
            raise NotFound(f"no replica with id {rid!r}", "replica_id")
        if rep.state == "dead":
            return rep
        rep.state = "draining"
        self.signal(rep, signal.SIGTERM if drain else signal.SIGKILL)
        try:
            await within(self.config.drain_timeout_s + 2.0 if drain else 5.0, rep.died.wait())
        except TimeoutError:
            self.signal(rep, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await within(5.0, rep.died.wait())
        return rep

    def resize(self, rid: str, cpus: float) -> Replica:
        """An in-place CPU change (QUART's CPU compensation, `quart_kernel.resize`): every thread of the replica gets
        ⌈cpus⌉ cores (pinned even where starts are not); the replica sizes its torch threads to them at its next
        request. Nothing restarts."""
        rep = self.by_id.get(rid)
        if rep is None or rep.state == "dead":
            raise NotFound(f"no live replica with id {rid!r}", "replica_id")
        if len(rep.cores) != min(len(self._cores), max(1, math.ceil(cpus))):
            cores = self._next_cores(cpus)
            sysutil.set_process_cores(rep.pid, cores)
            rep.cores = cores
        return rep

    # ---------------------------------------------------------------- death
    def exited(self, pid: int, status: int | None) -> None:
        """Process ``pid`` ended with ``status`` (reaped by us, or reported by its zygote)."""
        matches = [r for r in self.by_id.values() if r.pid == pid]
        live = [r for r in matches if r.state != "dead"]
        if live:
            self.mark_dead(live[0], status)
        elif matches and matches[-1].exit_status is None:  # the liveness check saw it die before the reaper
            matches[-1].exit_status = status

    def mark_dead(self, rep: Replica, status: int | None) -> None:
        rep.state = "dead"
        rep.exit_status = status
        rep.dead_at = time.monotonic()
        if rep.proc is not None and rep.proc.returncode is None and status is not None:
            rep.proc.returncode = status
        if rep.segment is not None:
            self.segments.release(rep.segment, rep.id)
        if rep.socket:
            with contextlib.suppress(OSError):
                os.unlink(rep.socket)
        rep.died.set()
        self._changed()
        dead = [r for r in self.by_id.values() if r.state == "dead"]
        for old in sorted(dead, key=lambda r: r.dead_at or 0)[:-DEAD_KEPT]:
            self.by_id.pop(old.id, None)

    def check_liveness(self, reported: Callable[[Replica], bool]) -> None:
        """Replicas we cannot reap (adopted, or grandchildren whose zygote report was lost). Our own children
        (reaped) and those whose exit ``reported`` (by a live zygote) are left to those: they bring the
        exit status, which a liveness check that sees the process gone first would lose."""
        for rep in list(self.by_id.values()):
            if rep.state == "dead" or (not rep.adopted and (rep.proc is not None or reported(rep))):
                continue
            if not sysutil.is_running(rep.pid, rep.create_time or None):
                self.mark_dead(rep, rep.exit_status)


def replica_socket_path(api_socket: Path, rid: str) -> Path:
    """``<API socket folder>/r/<id hex>.sock``: short (Unix socket paths are limited to 107 bytes), and inside
    the folder a stage pod mounts for the API socket (deploy/kubernetes), at the same path."""
    return api_socket.parent / "r" / f"{rid.rsplit('-', 1)[-1]}.sock"


def threads_of(spec: StageSpec) -> int:
    """Torch threads of one replica: its granted CPUs rounded up (at least 1), as many as the cores it is
    pinned to (``_take_cores``); nothing in its environment overrides them (QUART's CPU compensation)."""
    return max(1, math.ceil(spec.cpus))
