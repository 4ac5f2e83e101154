"""The KeysManager host agent: zygotes, fork/cold replica start, LRU eviction, invalidation, its API.

One asyncio process per (simulated) host. It never imports torch: zygotes and cold replicas are separate
interpreters (``keysmanager.zygote``). Process tree::

    KeysManager (child subreaper, holds the lifeline pipe's write end)
     ├─ zygote <function>     (dies with the KeysManager: PR_SET_PDEATHSIG)
     │   └─ replica (fork)    (exits when the lifeline pipe closes, unless told to survive)
     └─ replica (cold)

A replica whose zygote was evicted is re-parented to the KeysManager (subreaper) and keeps serving.
Every child is reaped: the zygote reaps its forks and reports them; the KeysManager reaps the rest.
API: JSON over HTTP on a Unix socket (mode 0600), in ``keysmanager.api``; see docs/keysmanager.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import psutil
from aiohttp import web

from keysmanager import sysutil
from keysmanager.aio import within
from keysmanager.api import build_app
from keysmanager.config import KeysManagerConfig
from keysmanager.errors import InvalidSpec, ManagerError, NoFreeSlot, NoRoom, NotFound, StartFailed
from keysmanager.eviction import CacheEntry, plan_eviction
from keysmanager.protocol import encode
from keysmanager.stage import StageRef, UnknownStage, resolve_stage
from keysmanager.types import FORK_MODES, HostReport, ReplicaInfo, StageSpec, ZygoteInfo

_DEAD_KEPT = 256  # dead replicas kept in listings (so a crash is reported, not just gone)


@dataclass(eq=False)
class _Segment:
    """A shared-memory parameter segment and who still maps it (for memory accounting)."""

    path: Path
    nbytes: int
    zygote_alive: bool = True
    users: set[str] = field(default_factory=set)  # replica ids forked from it


@dataclass(eq=False)
class _ForkedProc:
    """A zygote forked by the preloader: not our child, so its exit status arrives as a message."""

    pid: int
    returncode: int | None = None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)


@dataclass(eq=False)
class _Preloader:
    """The fork server of zygotes (``keysmanager.zygote --preloader``)."""

    proc: subprocess.Popen
    sock: socket.socket
    ready: asyncio.Future
    writer: asyncio.StreamWriter | None = None
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    alive: bool = True
    started_at: float = 0.0


@dataclass(eq=False)
class _Zygote:
    function: str
    stage: StageRef
    proc: subprocess.Popen | _ForkedProc
    segment: _Segment
    writer: asyncio.StreamWriter | None = None
    reader_task: asyncio.Task | None = None
    ready: asyncio.Future | None = None
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    load_ms: float = 0.0
    threads: int = 0
    last_used: float = 0.0
    alive: bool = True
    log_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass(eq=False)
class _Replica:
    id: str
    function: str
    pid: int
    port: int
    source: str
    mode: str
    survive: bool
    requested_at: float
    gpu_slot: int | None
    cores: list[int]
    segment: _Segment | None = None
    proc: subprocess.Popen | None = None  # cold replicas only (our direct children)
    create_time: float = 0.0
    state: str = "starting"
    ready_ms: float | None = None
    exit_status: int | None = None
    dead_at: float | None = None
    adopted: bool = False
    param_bytes: int = 0
    died: asyncio.Event = field(default_factory=asyncio.Event)


class KeysManager:
    """The host agent. Create, ``await start()``, serve the API, ``await close()``."""

    def __init__(self, config: KeysManagerConfig) -> None:
        self.config = config
        self.name = config.name
        self.state_dir = config.state_path
        self.socket_path = config.socket_path
        self.python = config.python or sys.executable
        self.zygotes: dict[str, _Zygote] = {}
        self.replicas: dict[str, _Replica] = {}
        self.segments: dict[Path, _Segment] = {}
        self.recovered: dict[str, list] = {"killed": [], "adopted": [], "removed_shm": []}
        self._cache_locks: dict[str, asyncio.Lock] = {}
        self._caching: set[str] = set()
        self.pinned: set[str] = set()  # zygotes the scheduler keeps (key stages): evicted last (see eviction.py)
        self._slots_used: set[int] = set()
        self._next_core = 0
        self._cores = sorted(os.sched_getaffinity(0))
        self._lifeline_r, self._lifeline_w = -1, -1
        self._generation = 0
        self._tasks: set[asyncio.Task] = set()
        self._monitor: asyncio.Task | None = None
        self._http: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._stopped = asyncio.Event()
        self._state_dirty = True
        self._all_zygote_procs: list[subprocess.Popen | _ForkedProc] = []  # zygotes (and preloader) still running
        self._preloader: _Preloader | None = None
        self._order_ids = itertools.count(1)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.state_dir, 0o700)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        self._take_pidfile()
        self._recover()
        sysutil.become_subreaper()
        self._lifeline_r, self._lifeline_w = os.pipe()  # both O_CLOEXEC; the read end is passed explicitly
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))
        app = build_app(self)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        old_umask = os.umask(0o177)  # the socket is created 0600: only our user may talk to us
        try:
            await web.UnixSite(self._runner, str(self.socket_path)).start()
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        self._monitor = asyncio.create_task(self._monitor_loop())
        if self.config.preload:
            await self._start_preloader()
        self._write_state()

    async def close(self) -> None:
        """Stop every replica that may not survive, drop every zygote, remove segments, socket and pidfile."""
        if self._monitor:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        victims = [r for r in self.replicas.values() if r.state != "dead" and not r.survive]
        for r in victims:
            self._signal(r, signal.SIGTERM)
        deadline = time.monotonic() + min(5.0, self.config.drain_timeout_s)
        while any(r.state != "dead" for r in victims) and time.monotonic() < deadline:
            self._reap()
            await asyncio.sleep(0.02)
        for r in victims:
            if r.state != "dead":
                self._signal(r, signal.SIGKILL)
        for z in list(self.zygotes.values()):
            await self._drop_zygote(z, "shutdown")
        if self._preloader is not None and self._preloader.alive:
            with contextlib.suppress(OSError):
                self._preloader.sock.send(encode({"op": "exit"}))
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and (any(r.state != "dead" for r in victims)
                                               or any(p.returncode is None for p in self._all_zygote_procs)):
            self._reap()
            await asyncio.sleep(0.02)
        for seg in list(self.segments.values()):
            seg.path.unlink(missing_ok=True)
        for t in list(self._tasks):
            t.cancel()
        if self._runner:
            await self._runner.cleanup()
        if self._http:
            await self._http.close()
        self.socket_path.unlink(missing_ok=True)
        self._state_dirty = True
        self._write_state()
        if not any(r.survive and r.state != "dead" for r in self.replicas.values()):
            (self.state_dir / "state.json").unlink(missing_ok=True)
        (self.state_dir / "km.pid").unlink(missing_ok=True)
        for fd in (self._lifeline_r, self._lifeline_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._stopped.set()

    def _take_pidfile(self) -> None:
        pidfile = self.state_dir / "km.pid"
        try:
            old = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            old = 0
        if old and old != os.getpid() and sysutil.is_running(old):
            try:
                cmd = " ".join(psutil.Process(old).cmdline())
            except psutil.Error:
                cmd = ""
            if "keysmanager" in cmd or "quartctl" in cmd or "pytest" in cmd:
                raise RuntimeError(f"another KeysManager (pid {old}) uses the state dir {self.state_dir}")
        pidfile.write_text(f"{os.getpid()} {sysutil.create_time(os.getpid())}\n")

    def _recover(self) -> None:
        """Clean up what a previous KeysManager with this name left: kill its zygotes and replicas (adopt
        the replicas told to survive), remove its shared-memory segments."""
        state_file = self.state_dir / "state.json"
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            state = {}
        for z in state.get("zygotes", []):
            if sysutil.is_running(z["pid"], z.get("create_time")):
                with contextlib.suppress(OSError):
                    os.kill(z["pid"], signal.SIGKILL)
                self.recovered["killed"].append(z["pid"])
        for r in state.get("replicas", []):
            if not sysutil.is_running(r["pid"], r.get("create_time")):
                continue
            if r.get("survive"):
                rep = _Replica(id=r["id"], function=r["function"], pid=r["pid"], port=r["port"],
                               source=r["source"], mode=r.get("mode", "cow"), survive=True,
                               requested_at=time.monotonic(), gpu_slot=r.get("gpu_slot"), cores=[],
                               create_time=r.get("create_time", 0.0), state="ready", adopted=True,
                               ready_ms=r.get("ready_ms"))
                self.replicas[rep.id] = rep
                if rep.gpu_slot is not None:
                    self._slots_used.add(rep.gpu_slot)
                self.recovered["adopted"].append(r["pid"])
            else:
                with contextlib.suppress(OSError):
                    os.kill(r["pid"], signal.SIGKILL)
                self.recovered["killed"].append(r["pid"])
        shm_dir = Path(self.config.shm_dir)
        for path in shm_dir.glob(self.config.shm_prefix + "*"):
            path.unlink(missing_ok=True)
            self.recovered["removed_shm"].append(str(path))
        self._state_dirty = True

    def _write_state(self) -> None:
        if not self._state_dirty:
            return
        state = {
            "name": self.name,
            "pid": os.getpid(),
            "zygotes": [{"function": z.function, "pid": z.pid, "create_time": sysutil.create_time(z.pid),
                         "shm_path": str(z.segment.path)} for z in self.zygotes.values() if z.alive],
            "replicas": [{"id": r.id, "function": r.function, "pid": r.pid, "port": r.port, "source": r.source,
                          "mode": r.mode, "survive": r.survive, "gpu_slot": r.gpu_slot, "ready_ms": r.ready_ms,
                          "create_time": r.create_time or sysutil.create_time(r.pid)}
                         for r in self.replicas.values() if r.state != "dead"],
        }
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_dir / "state.json")
        self._state_dirty = False

    def _resolve(self, spec: StageSpec) -> StageRef:
        try:
            return resolve_stage(spec.function, spec.env)
        except UnknownStage as exc:
            raise NotFound(f"unknown stage for function {spec.function!r}: {exc}", exc.field) from None
        except ValueError as exc:
            raise InvalidSpec(f"bad stage environment for {spec.function!r}: {exc}", "spec.env") from None

    # ---------------------------------------------------------------- memory
    def memory_used(self) -> int:
        """Parameter bytes held: live segments (a zygote or a replica still maps them) + private copies
        (isolated forks and cold replicas)."""
        held = sum(s.nbytes for s in self.segments.values() if s.zygote_alive or s.users)
        copies = sum(r.param_bytes for r in self.replicas.values()
                     if r.state != "dead" and (r.mode == "isolated" or r.source == "cold"))
        return held + copies

    def memory_limit(self) -> int:
        """The explicit limit, or what the threshold leaves us: threshold × total − (others' use)."""
        if self.config.memory_limit:
            return self.config.memory_limit
        vm = psutil.virtual_memory()
        others = max(0, (vm.total - vm.available) - self.memory_used())
        return max(0, int(self.config.memory_threshold * vm.total) - others)

    def _cache_entries(self) -> list[CacheEntry]:
        entries = []
        for z in self.zygotes.values():
            live = self._live_replicas(z.function)
            freed = z.segment.nbytes if not z.segment.users else 0
            entries.append(CacheEntry(z.function, freed, z.last_used, live, pinned=z.function in self.pinned))
        return entries

    def _live_replicas(self, function: str) -> int:
        return sum(1 for r in self.replicas.values() if r.function == function and r.state != "dead")

    async def _make_room(self, incoming: int, protect: set[str], evict_pinned: bool = True) -> None:
        plan = plan_eviction(self._cache_entries(), self.memory_used(), self.memory_limit(), incoming,
                             protect | self._caching, evict_pinned=evict_pinned)
        if incoming and not plan.satisfied:
            plan = replace(plan, evict=())  # the stage cannot be cached anyway: keep what is cached
        for function in plan.evict:
            z = self.zygotes.get(function)
            if z is not None:
                await self._drop_zygote(z, "evicted (LRU)")
        if not plan.satisfied:
            raise NoRoom(f"not enough host memory to cache {incoming} bytes: {self.memory_used()} used of "
                                f"a {self.memory_limit()}-byte limit, and evicting every unprotected zygote"
                                + ("" if evict_pinned else " that is not pinned") + " would not make room", "spec")

    # ---------------------------------------------------------------- zygotes
    async def ensure_cached(self, spec: StageSpec, evict_pinned: bool = True) -> _Zygote:
        """The stage's zygote, loading it (after LRU eviction) when there is none. ``evict_pinned=False``: fail
        (507) rather than drop a pinned zygote to make room."""
        stage = self._resolve(spec)
        lock = self._cache_locks.setdefault(spec.function, asyncio.Lock())
        async with lock:
            z = self.zygotes.get(spec.function)
            if z is not None and z.alive and z.stage.fingerprint == stage.fingerprint:
                z.last_used = time.monotonic()
                return z
            if z is not None:
                await self._drop_zygote(z, "checkpoint or environment changed")
            self._caching.add(spec.function)
            try:
                await self._make_room(stage.param_bytes, {spec.function}, evict_pinned)
                return await self._spawn_zygote(spec, stage)
            finally:
                self._caching.discard(spec.function)

    async def _spawn_zygote(self, spec: StageSpec, stage: StageRef) -> _Zygote:
        self._generation += 1
        safe = spec.function.replace("/", "_")
        shm_path = Path(self.config.shm_dir) / f"{self.config.shm_prefix}{safe}-{self._generation}"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log_path = self.state_dir / "logs" / f"zygote-{safe}-{self._generation}.log"
        env = {**self._child_env(), **spec.env}
        proc: subprocess.Popen | _ForkedProc | None = await self._spawn_via_preloader(theirs, env, shm_path,
                                                                                       log_path)
        if proc is None:  # no preloader (disabled, starting, or failed): a fresh interpreter
            cmd = [self.python, "-m", "keysmanager.zygote", "--parent-pid", str(os.getpid()),
                   "--control-fd", str(theirs.fileno()), "--lifeline-fd", str(self._lifeline_r),
                   "--shm-path", str(shm_path), "--drain-timeout", str(self.config.drain_timeout_s)]
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        pass_fds=(theirs.fileno(), self._lifeline_r))
        theirs.close()
        self._all_zygote_procs.append(proc)
        segment = _Segment(shm_path, stage.param_bytes)
        self.segments[shm_path] = segment
        z = _Zygote(spec.function, stage, proc, segment, log_path=log_path, last_used=time.monotonic())
        z.ready = asyncio.get_running_loop().create_future()
        reader, z.writer = await asyncio.open_unix_connection(sock=ours)
        z.reader_task = self._spawn_task(self._zygote_reader(z, reader))
        self.zygotes[spec.function] = z
        self._state_dirty = True
        try:
            hello = await within(self.config.zygote_timeout_s, asyncio.shield(z.ready))
        except (TimeoutError, RuntimeError) as exc:
            await self._drop_zygote(z, "failed to load")
            tail = _tail(log_path)
            raise StartFailed(f"the zygote of {spec.function!r} did not load its parameters: {exc}. "
                                f"Log tail: {tail}", "spec") from None
        z.load_ms = float(hello.get("load_ms", 0.0))
        z.threads = int(hello.get("threads", 0))
        segment.nbytes = int(hello.get("param_bytes", stage.param_bytes))
        self._write_state()
        return z

    def _child_env(self) -> dict[str, str]:
        # OpenBLAS (numpy) starts a thread pool when loaded unless told not to: a zygote must have none
        return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    async def _start_preloader(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [self.python, "-m", "keysmanager.zygote", "--preloader", "--parent-pid", str(os.getpid()),
               "--control-fd", str(theirs.fileno()), "--lifeline-fd", str(self._lifeline_r),
               "--drain-timeout", str(self.config.drain_timeout_s)]
        with open(self.state_dir / "logs" / "preloader.log", "ab") as log:
            proc = subprocess.Popen(cmd, env=self._child_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    pass_fds=(theirs.fileno(), self._lifeline_r))
        theirs.close()
        self._all_zygote_procs.append(proc)
        pre = _Preloader(proc, ours, asyncio.get_running_loop().create_future(), started_at=time.monotonic())
        reader, pre.writer = await asyncio.open_unix_connection(sock=ours)
        self._preloader = pre
        self._spawn_task(self._preloader_reader(pre, reader))

    async def _preloader_reader(self, pre: _Preloader, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                op = msg.get("op")
                if op == "ready" and not pre.ready.done():
                    pre.ready.set_result(msg)
                elif op == "failed" and not pre.ready.done():
                    pre.ready.set_exception(RuntimeError(msg.get("error", "failed")))
                elif op in ("spawned", "error"):
                    fut = pre.pending.pop(msg.get("id"), None)
                    if fut and not fut.done():
                        fut.set_result(msg)
                elif op == "exited":
                    for proc in self._all_zygote_procs:
                        if isinstance(proc, _ForkedProc) and proc.pid == msg["pid"]:
                            proc.returncode = int(msg["status"])
        except (ConnectionError, ValueError):
            pass
        finally:
            pre.alive = False
            if not pre.ready.done():
                pre.ready.set_exception(RuntimeError("the preloader exited"))
            if not pre.ready.cancelled():
                pre.ready.exception()  # retrieved: a failed preloader only means zygotes start fresh
            for fut in pre.pending.values():
                if not fut.done():
                    fut.set_result({"op": "error", "error": "the preloader exited"})

    async def _spawn_via_preloader(self, theirs: socket.socket, env: dict[str, str], shm_path: Path,
                                   log_path: Path) -> _ForkedProc | None:
        """Fork a zygote from the preloader; None when there is no usable preloader (the caller spawns one)."""
        pre = self._preloader
        if pre is None or not pre.alive:
            if self.config.preload and (pre is None or time.monotonic() - pre.started_at > 30.0):
                await self._start_preloader()  # ready for the next stage; this one starts fresh
            return None
        try:
            await within(self.config.zygote_timeout_s, asyncio.shield(pre.ready))
        except (TimeoutError, RuntimeError):
            return None
        oid = next(self._order_ids)
        fut = asyncio.get_running_loop().create_future()
        pre.pending[oid] = fut
        message = encode({"op": "spawn", "id": oid, "env": env, "shm_path": str(shm_path),
                          "log_path": str(log_path)})
        try:
            socket.send_fds(pre.sock, [message], [theirs.fileno()])
            answer = await within(30.0, fut)
        except (OSError, TimeoutError):
            pre.pending.pop(oid, None)
            return None
        if answer.get("op") != "spawned":
            return None
        proc = _ForkedProc(int(answer["pid"]))
        self._all_zygote_procs.append(proc)
        return proc

    async def _zygote_reader(self, z: _Zygote, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                msg = json.loads(line)
                op = msg.get("op")
                if op == "ready" and z.ready and not z.ready.done():
                    z.ready.set_result(msg)
                elif op == "failed" and z.ready and not z.ready.done():
                    z.ready.set_exception(RuntimeError(msg.get("error", "failed")))
                elif op in ("forked", "error"):
                    fut = z.pending.pop(msg.get("id"), None)
                    if fut and not fut.done():
                        fut.set_result(msg)
                elif op == "exited":
                    self._mark_dead_pid(int(msg["pid"]), int(msg["status"]))
        except (ConnectionError, ValueError):
            pass
        finally:
            z.alive = False
            if z.ready and not z.ready.done():
                z.ready.set_exception(RuntimeError("the zygote exited"))
            for fut in z.pending.values():
                if not fut.done():
                    fut.set_result({"op": "error", "error": "the zygote exited"})
            z.pending.clear()
            if self.zygotes.get(z.function) is z:
                self._forget_zygote(z)

    def _forget_zygote(self, z: _Zygote) -> None:
        z.alive = False
        if self.zygotes.get(z.function) is z:
            del self.zygotes[z.function]
        z.segment.zygote_alive = False
        z.segment.path.unlink(missing_ok=True)  # replicas keep their mappings; the name goes now
        if not z.segment.users:
            self.segments.pop(z.segment.path, None)
        self._state_dirty = True

    async def _drop_zygote(self, z: _Zygote, reason: str) -> None:
        """Stop a zygote (its replicas keep serving) and release its segment's name."""
        self._forget_zygote(z)
        if z.writer is not None and not z.writer.is_closing():
            with contextlib.suppress(ConnectionError, RuntimeError):
                z.writer.write(encode({"op": "exit", "reason": reason}))
                await z.writer.drain()
            z.writer.close()
        deadline = time.monotonic() + 2.0
        while z.proc.returncode is None and time.monotonic() < deadline:
            self._reap()
            await asyncio.sleep(0.01)
        if z.proc.returncode is None:
            with contextlib.suppress(OSError):
                z.proc.kill()

    # ---------------------------------------------------------------- replicas
    def _take_slot(self) -> int | None:
        if self.config.gpus == 0:
            return None
        for slot in range(self.config.gpus):
            if slot not in self._slots_used:
                self._slots_used.add(slot)
                return slot
        raise NoFreeSlot(f"host {self.name} has no free GPU slot ({self.config.gpus} in use)", "count")

    def _take_cores(self, cpus: float) -> list[int]:
        if not self.config.pin_cpus:
            return []
        n = min(len(self._cores), max(1, math.ceil(cpus)))
        cores = [self._cores[(self._next_core + i) % len(self._cores)] for i in range(n)]
        self._next_core = (self._next_core + n) % len(self._cores)
        return cores

    def _replica_env(self, spec: StageSpec, slot: int | None) -> dict[str, str]:
        env = {"QUART_REPLICA_HOST": self.name}
        if slot is not None and spec.env.get("QUART_COMPUTE") == "cuda" and "CUDA_VISIBLE_DEVICES" not in spec.env:
            env["CUDA_VISIBLE_DEVICES"] = str(slot)  # the device decides where prepare_device copies parameters
        return env

    async def start_replicas(self, spec: StageSpec, count: int, mode: str, survive: bool, wait: bool,
                             cache: bool, cold: bool = False) -> list[_Replica]:
        """Fork ``count`` replicas from the stage's zygote, or cold-start them when it has none (and cache the stage
        when ``cache``). ``cold``: always cold-start, never touching the cache (a function deployed without the
        KeysManager, ``com.quart.keysmanager: off``)."""
        requested_at = time.monotonic()
        stage = self._resolve(spec)
        if self.config.gpus and count > self.config.gpus - len(self._slots_used):
            raise NoFreeSlot(f"host {self.name} has {self.config.gpus - len(self._slots_used)} free GPU slots; "
                                f"asked for {count}", "count")
        z = None if cold else self.zygotes.get(spec.function)
        if z is not None and z.alive and z.stage.fingerprint != stage.fingerprint:
            await self._drop_zygote(z, "checkpoint or environment changed")
            z = None
        if z is not None and z.ready is not None and not z.ready.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(z.ready)  # being cached right now: wait, then fork
        started: list[_Replica] = []
        threads = _threads(spec)
        if z is not None and z.alive and z.ready is not None and z.ready.done() and not z.ready.exception():
            z.last_used = time.monotonic()
            for _ in range(count):
                started.append(await self._fork(z, spec, mode, survive, threads, requested_at))
        else:
            for _ in range(count):
                started.append(self._spawn_cold(spec, stage, mode, survive, threads, requested_at))
            if cache and not cold:
                self._spawn_task(self._cache_quietly(spec))
        self._state_dirty = True
        self._write_state()  # before answering: a restart must know these processes even if we die now
        waits = [self._spawn_task(self._await_ready(r)) for r in started]
        if wait and waits:
            await asyncio.gather(*waits)
        return started

    async def _cache_quietly(self, spec: StageSpec) -> None:
        """Cache what a cold start just loaded, unless that would displace a pinned (key-stage) zygote."""
        with contextlib.suppress(ManagerError):
            await self.ensure_cached(spec, evict_pinned=False)

    async def _fork(self, z: _Zygote, spec: StageSpec, mode: str, survive: bool, threads: int,
                    requested_at: float) -> _Replica:
        slot = self._take_slot()
        cores = self._take_cores(spec.cpus)
        rid = f"{spec.function}-{uuid.uuid4().hex[:8]}"
        order_id = next(self._order_ids)
        fut = asyncio.get_running_loop().create_future()
        z.pending[order_id] = fut
        assert z.writer is not None
        z.writer.write(encode({"op": "fork", "id": order_id, "replica_id": rid, "mode": mode, "survive": survive,
                               "env": self._replica_env(spec, slot), "cores": cores, "threads": threads}))
        await z.writer.drain()
        answer = await within(30.0, fut)
        if answer.get("op") != "forked":
            self._slots_used.discard(slot)
            raise StartFailed(f"fork of {spec.function!r} failed: {answer.get('error')}", "spec")
        rep = _Replica(rid, spec.function, int(answer["pid"]), int(answer["port"]), "fork", mode, survive,
                       requested_at, slot, cores, segment=z.segment, param_bytes=z.segment.nbytes)
        rep.create_time = sysutil.create_time(rep.pid)
        z.segment.users.add(rid)
        self.replicas[rid] = rep
        return rep

    def _spawn_cold(self, spec: StageSpec, stage: StageRef, mode: str, survive: bool, threads: int,
                    requested_at: float) -> _Replica:
        slot = self._take_slot()
        cores = self._take_cores(spec.cpus)
        rid = f"{spec.function}-{uuid.uuid4().hex[:8]}"
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.bind(("127.0.0.1", 0))
        listen.listen(1024)
        port = listen.getsockname()[1]
        log_path = self.state_dir / "logs" / f"{rid}.log"
        env = {**os.environ, **spec.env, **self._replica_env(spec, slot), "PYTHONUNBUFFERED": "1"}
        cmd = [self.python, "-m", "keysmanager.zygote", "--cold", "--parent-pid", str(os.getpid()),
               "--listen-fd", str(listen.fileno()), "--lifeline-fd", str(self._lifeline_r),
               "--drain-timeout", str(self.config.drain_timeout_s), "--threads", str(threads),
               "--cores", ",".join(map(str, cores))] + (["--survive"] if survive else [])
        try:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        pass_fds=(listen.fileno(), self._lifeline_r))
        finally:
            listen.close()  # the child holds the socket now: no port stays open behind it
        rep = _Replica(rid, spec.function, proc.pid, port, "cold", mode, survive, requested_at, slot, cores,
                       proc=proc, param_bytes=stage.param_bytes)
        rep.create_time = sysutil.create_time(proc.pid)
        self.replicas[rid] = rep
        return rep

    async def _await_ready(self, rep: _Replica) -> None:
        """Healthy once ``GET /_/health`` answers 200 (the request waits in the listen backlog until then)."""
        assert self._http is not None
        deadline = rep.requested_at + self.config.ready_timeout_s
        url = f"http://127.0.0.1:{rep.port}/_/health"
        while rep.state == "starting":
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._signal(rep, signal.SIGKILL)
                return
            try:
                async with self._http.get(url, timeout=aiohttp.ClientTimeout(total=remaining)) as resp:
                    if resp.status == 200 and rep.state == "starting":
                        rep.ready_ms = (time.monotonic() - rep.requested_at) * 1e3
                        rep.state = "ready"
                        self._state_dirty = True
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.005)

    def _signal(self, rep: _Replica, sig: int) -> None:
        if rep.state == "dead":
            return
        if rep.adopted and not sysutil.is_running(rep.pid, rep.create_time):
            self._mark_dead(rep, None)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(rep.pid, sig)

    async def stop(self, rid: str, drain: bool) -> _Replica:
        rep = self.replicas.get(rid)
        if rep is None:
            raise NotFound(f"no replica with id {rid!r}", "replica_id")
        if rep.state == "dead":
            return rep
        rep.state = "draining"
        self._signal(rep, signal.SIGTERM if drain else signal.SIGKILL)
        try:
            await within(self.config.drain_timeout_s + 2.0 if drain else 5.0, rep.died.wait())
        except TimeoutError:
            self._signal(rep, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await within(5.0, rep.died.wait())
        return rep

    # ---------------------------------------------------------------- reaping and monitoring
    def _mark_dead_pid(self, pid: int, status: int | None) -> None:
        matches = [r for r in self.replicas.values() if r.pid == pid]
        live = [r for r in matches if r.state != "dead"]
        if live:
            self._mark_dead(live[0], status)
        elif matches and matches[-1].exit_status is None:  # the liveness check saw it die before the reaper
            matches[-1].exit_status = status

    def _mark_dead(self, rep: _Replica, status: int | None) -> None:
        rep.state = "dead"
        rep.exit_status = status
        rep.dead_at = time.monotonic()
        if rep.proc is not None and rep.proc.returncode is None and status is not None:
            rep.proc.returncode = status
        if rep.gpu_slot is not None:
            self._slots_used.discard(rep.gpu_slot)
        if rep.segment is not None:
            rep.segment.users.discard(rep.id)
            if not rep.segment.users and not rep.segment.zygote_alive:
                self.segments.pop(rep.segment.path, None)
        rep.died.set()
        self._state_dirty = True
        dead = [r for r in self.replicas.values() if r.state == "dead"]
        for old in sorted(dead, key=lambda r: r.dead_at or 0)[:-_DEAD_KEPT]:
            self.replicas.pop(old.id, None)

    def _reap(self) -> None:
        """Reap every ended child or orphan re-parented to us (we are a subreaper)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            for proc in self._all_zygote_procs:
                if proc.pid == pid:
                    proc.returncode = code
            self._mark_dead_pid(pid, code)
        self._all_zygote_procs = [p for p in self._all_zygote_procs if p.returncode is None]

    def _check_liveness(self) -> None:
        """Replicas we cannot reap (adopted, or grandchildren whose zygote report was lost). Our own children
        (``_reap``) and the forks of a live zygote (its ``exited`` report) are left to those: they bring the
        exit status, which a liveness check that sees the process gone first would lose."""
        for rep in list(self.replicas.values()):
            if rep.state == "dead" or (not rep.adopted and (rep.proc is not None or self._zygote_reports(rep))):
                continue
            if not sysutil.is_running(rep.pid, rep.create_time or None):
                self._mark_dead(rep, rep.exit_status)

    def _zygote_reports(self, rep: _Replica) -> bool:
        """Whether the zygote that forked ``rep`` is alive (and so reaps it and reports its exit)."""
        z = self.zygotes.get(rep.function)
        return rep.source == "fork" and z is not None and z.alive and rep.segment is z.segment

    async def _check_checkpoints(self) -> None:
        """Invalidation: drop a zygote whose stage file or manifest changed (sha256 in the manifest)."""
        for z in list(self.zygotes.values()):
            if not z.alive or z.ready is None or not z.ready.done():
                continue
            try:
                current = resolve_stage(z.function, z.stage.env)
            except (UnknownStage, ValueError):
                await self._drop_zygote(z, "stage checkpoint removed")
                continue
            if current.fingerprint != z.stage.fingerprint:
                await self._drop_zygote(z, "checkpoint changed")

    async def _monitor_loop(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self.config.monitor_interval_s)
            tick += 1
            try:
                self._reap()
                if tick % 5 == 0:
                    self._check_liveness()
                if tick % 10 == 0:
                    await self._check_checkpoints()
                    if self.memory_used() > self.memory_limit():
                        with contextlib.suppress(ManagerError):
                            await self._make_room(0, set())
                self._write_state()
            except Exception as exc:  # the monitor must survive anything; say what happened
                print(f"keysmanager {self.name}: monitor error: {exc!r}", file=sys.stderr, flush=True)

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---------------------------------------------------------------- views
    def replica_info(self, rep: _Replica, memory: bool = True) -> ReplicaInfo:
        rss, pss = sysutil.memory_of(rep.pid) if memory and rep.state != "dead" else (0, 0)
        return ReplicaInfo(id=rep.id, function=rep.function, host=self.name, pid=rep.pid, port=rep.port,
                           url=f"http://127.0.0.1:{rep.port}", state=rep.state, source=rep.source,
                           ready_ms=rep.ready_ms, rss_bytes=rss, pss_bytes=pss, mode=rep.mode,
                           survive=rep.survive, gpu_slot=rep.gpu_slot, exit_status=rep.exit_status)

    def zygote_info(self, z: _Zygote, memory: bool = True) -> ZygoteInfo:
        rss, pss = sysutil.memory_of(z.pid) if memory else (0, 0)
        return ZygoteInfo(function=z.function, pid=z.pid, param_bytes=z.segment.nbytes, sha256=z.stage.sha256,
                          shm_path=str(z.segment.path), load_ms=z.load_ms, last_used=z.last_used,
                          live_replicas=self._live_replicas(z.function), threads=z.threads,
                          rss_bytes=rss, pss_bytes=pss)

    def report(self) -> HostReport:
        cached = sorted(f for f, z in self.zygotes.items() if z.alive and z.ready is not None and z.ready.done()
                        and not z.ready.exception())
        live = [r for r in self.replicas.values() if r.state != "dead"]
        return HostReport(name=self.name, cached=cached, memory_used=self.memory_used(),
                          memory_limit=self.memory_limit(), gpu_slots=self.config.gpus,
                          gpu_used=len(self._slots_used), replicas=len(live),
                          host_memory_percent=psutil.virtual_memory().percent)

    def pin(self, functions: list[str]) -> list[str]:
        """Replace the set of pinned stages (the scheduler's ``keep_cached`` for this host); returns it sorted.
        A pin stops a key stage's zygote from being traded for another zygote; it does not stop the host
        getting back under its memory limit (pinned zygotes are then evicted last)."""
        self.pinned = set(functions)
        return sorted(self.pinned)

    async def invalidate(self, function: str) -> bool:
        """Drop the stage's zygote (its replicas keep serving); False when it was not cached."""
        z = self.zygotes.get(function)
        if z is not None:
            await self._drop_zygote(z, "invalidated")
        return z is not None

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def _threads(spec: StageSpec) -> int:
    raw = spec.env.get("QUART_THREADS")
    if raw and raw.isdigit() and int(raw) > 0:
        return int(raw)
    return max(1, math.floor(spec.cpus))


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return "(no log)"


async def serve(config: KeysManagerConfig) -> None:
    """Run a KeysManager until SIGTERM/SIGINT or ``POST /v1/shutdown``."""
    km = KeysManager(config)
    await km.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, km.request_stop)
    print(f"keysmanager {config.name} listening on {km.socket_path}", flush=True)
    try:
        await km.wait_stopped()
    finally:
        km._stopped.clear()
        await km.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="quartctl keysmanager", description="run one KeysManager host agent")
    parser.add_argument("--name", help="host name (default host-0)")
    parser.add_argument("--socket", help="API Unix socket path (default <state-dir>/km.sock)")
    parser.add_argument("--state-dir", help="pidfile, state and logs (default $XDG_RUNTIME_DIR or /tmp)")
    parser.add_argument("--memory-limit", type=int, help="bytes of parameters this host may cache (default: "
                                                         "85%% of host memory, see --memory-threshold)")
    parser.add_argument("--memory-threshold", type=float, help="fraction of host memory that triggers eviction")
    parser.add_argument("--gpus", type=int, help="GPU slots of this host (0 = CPU host)")
    parser.add_argument("--fork-mode", choices=FORK_MODES, help="default replica mode (cow)")
    parser.add_argument("--shm-dir", help="parameter segments folder (default /dev/shm)")
    args = parser.parse_args(argv)
    try:
        config = KeysManagerConfig.from_env(
            name=args.name, socket=args.socket, state_dir=args.state_dir, memory_limit=args.memory_limit,
            memory_threshold=args.memory_threshold, gpus=args.gpus, fork_mode=args.fork_mode,
            shm_dir=args.shm_dir)
        asyncio.run(serve(config))
    except (ValueError, RuntimeError) as exc:
        print(f"quartctl keysmanager: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
