"""The KeysManager host agent: zygotes, fork/cold replica start, LRU eviction, invalidation, recovery.

One asyncio process per (simulated) host. It never imports torch: zygotes and cold replicas are separate
interpreters (``keysmanager.zygote``). Process tree::

    KeysManager (child subreaper, holds the lifeline pipe's write end)
     ├─ zygote <function>     (dies with the KeysManager: PR_SET_PDEATHSIG)
     │   └─ replica (fork)    (exits when the lifeline pipe closes, unless told to survive)
     └─ replica (cold)

A replica whose zygote was evicted is re-parented to the KeysManager (subreaper) and keeps serving.
Every child is reaped: the zygote reaps its forks and reports them; the KeysManager reaps the rest.
The pieces: ``zygotes`` (cached stages), ``replicas`` (start, stop, death), ``recovery`` (state dir across
restarts), ``eviction`` (the pure LRU rule). This class ties them together and raises only
``keysmanager.errors``; the HTTP API (``keysmanager.api``) and the process (``keysmanager.server``) are apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from keysmanager import sysutil
from keysmanager.auth import read_token
from keysmanager.config import KeysManagerConfig
from keysmanager.errors import InvalidSpec, ManagerError, NoRoom, NotFound
from keysmanager.eviction import CacheEntry, plan_eviction
from keysmanager.landing import LandingReserve
from keysmanager.launcher import Launcher
from keysmanager.live import held_of, start_live
from keysmanager.localize import Localizer
from keysmanager.peers import StageFile
from keysmanager.records import Replica, Segments, Zygote
from keysmanager.recovery import Recovered, StateFile, recover
from keysmanager.registry import MANIFEST
from keysmanager.replicas import Replicas
from keysmanager.stage import StageRef, UnknownStage, resolve_stage
from keysmanager.types import HostReport, ReplicaInfo, StageSpec, ZygoteInfo
from keysmanager.zygotes import Zygotes


class KeysManager:
    """The host agent. Create, ``await start()`` (after ``recovery.claim_state_dir``), ``await close()``."""

    def __init__(self, config: KeysManagerConfig) -> None:
        self.config = config
        self.name = config.name
        self.state_dir = config.state_path
        self.recovered = Recovered().summary()
        self.sole: set[str] = set()  # stages no other host holds (the gateway says): evicted after duplicates
        self.pinned: set[str] = set()  # zygotes the scheduler keeps (key stages): evicted last (see eviction.py)
        self._state = StateFile(self.state_dir)
        self._launcher = Launcher(config)
        self._segments = Segments()
        self.replicas = Replicas(config, self._launcher, self._segments, self._state.touch)
        self.zygotes = Zygotes(config, self._launcher, self._segments, self.spawn_task, self._reap,
                               self.replicas.exited, self._state.touch)
        self._cache_locks: dict[str, asyncio.Lock] = {}
        self.landing = LandingReserve(self.state_dir / "landing", config.landing_mb << 20)
        self.localizer = Localizer(self.state_dir, read_token(config.token_file) if config.token_file else None,
                                   self.landing)
        self.localizer.part_read_timeout_s = config.part_read_timeout_s
        self._caching: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._monitor: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Clean up after the last KeysManager of this state dir, then start the monitor (and preloader)."""
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        found = recover(self._state.read(), self.config)
        for rep in found.replicas:
            self.replicas.adopt(rep)
        self.recovered = found.summary()
        self._state.touch()
        sysutil.become_subreaper()
        self._launcher.open()
        self.replicas.open()
        self._monitor = asyncio.create_task(self._monitor_loop())
        if self.config.preload:
            await self.zygotes.start_preloader()
        self.landing.start()  # after the preloader: its imports come first; the reserve fills with spare CPU
        self._write_state()

    async def close(self) -> None:
        """Stop every replica that may not survive, drop every zygote, remove segments and (unless a survivor
        needs it) the state file."""
        if self._monitor:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        victims = [r for r in self.replicas.live() if not r.survive]
        for r in victims:
            self.replicas.signal(r, signal.SIGTERM)
        await self._reap_until(lambda: all(r.state == "dead" for r in victims),
                               min(5.0, self.config.drain_timeout_s))
        for r in victims:
            if r.state != "dead":
                self.replicas.signal(r, signal.SIGKILL)
        await self.zygotes.drop_all("shutdown")
        self.zygotes.stop_preloader()
        await self._reap_until(lambda: all(r.state == "dead" for r in victims) and not self.zygotes.running(), 3.0)
        self._segments.unlink_all()
        await asyncio.to_thread(self.landing.stop)
        for t in list(self._tasks):
            t.cancel()
        await self.replicas.close()
        self._state.touch()
        self._write_state()
        if not any(r.survive for r in self.replicas.live()):
            self._state.remove()
        self._launcher.close()
        self._stopped.set()

    async def _reap_until(self, done, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            self._reap()
            await asyncio.sleep(0.02)

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _write_state(self) -> None:
        self._state.write(self.name, self.zygotes.alive(), self.replicas.live())

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
        copies = sum(r.param_bytes for r in self.replicas.live() if r.mode == "isolated" or r.source == "cold")
        return self._segments.held_bytes() + copies

    def memory_limit(self) -> int:
        """The explicit limit, or what the threshold leaves us: threshold × total − (others' use)."""
        if self.config.memory_limit:
            return self.config.memory_limit
        vm = psutil.virtual_memory()
        others = max(0, (vm.total - vm.available) - self.memory_used())
        return max(0, int(self.config.memory_threshold * vm.total) - others)

    def _cache_entries(self) -> list[CacheEntry]:
        return [CacheEntry(z.function, z.segment.nbytes if not z.segment.users else 0, z.last_used,
                           len(self.replicas.live(z.function)), pinned=z.function in self.pinned,
                           sole_copy=z.function in self.sole)
                for z in self.zygotes.by_function.values()]

    async def _make_room(self, incoming: int, protect: set[str], evict_pinned: bool = True) -> None:
        plan = plan_eviction(self._cache_entries(), self.memory_used(), self.memory_limit(), incoming,
                             protect | self._caching, evict_pinned=evict_pinned)
        if incoming and not plan.satisfied:
            plan = replace(plan, evict=())  # the stage cannot be cached anyway: keep what is cached
        for function in plan.evict:
            z = self.zygotes.get(function)
            if z is not None:
                await self.zygotes.drop(z, "evicted (LRU)")
        if not plan.satisfied:
            raise NoRoom(f"not enough host memory to cache {incoming} bytes: {self.memory_used()} used of "
                         f"a {self.memory_limit()}-byte limit, and evicting every unprotected zygote"
                         + ("" if evict_pinned else " that is not pinned") + " would not make room", "spec")

    # ---------------------------------------------------------------- caching and starting
    async def localize(self, spec: StageSpec, peers: Sequence[str] = ()) -> StageSpec:
        """A stage deployed from the model registry (``QUART_MODEL_URL``) with its local model folder, fetched
        once per host from a peer in ``peers`` or the registry (``keysmanager.localize``)."""
        return await self.localizer.localize(spec, peers)

    def stage_file(self, function: str) -> StageFile | None:
        """The stage file this host can serve to peers: fetched here (or arriving), or a cached stage's own."""
        held = self.localizer.files.get(function)
        if held is not None:
            return held
        z = self.zygotes.get(function)
        if z is not None and z.alive and z.stage.checkpoint is not None and z.stage.checkpoint.exists():
            return StageFile(function, z.stage.checkpoint, z.stage.sha256, z.stage.checkpoint.stat().st_size)
        return None

    async def ensure_cached(self, spec: StageSpec, evict_pinned: bool = True, peers: Sequence[str] = ()) -> Zygote:
        """The stage's zygote, loading it (after LRU eviction) when there is none. ``evict_pinned=False``: fail
        (NoRoom) rather than drop a pinned zygote to make room. ``peers``: KeysManagers that hold the stage."""
        spec = await self.localize(spec, peers)
        stage = self._resolve(spec)
        lock = self._cache_locks.setdefault(spec.function, asyncio.Lock())
        async with lock:
            z = self.zygotes.get(spec.function)
            if z is not None and z.alive and z.stage.fingerprint == stage.fingerprint:
                z.last_used = time.monotonic()
                return z
            if z is not None:
                await self.zygotes.drop(z, "checkpoint or environment changed")
            self._caching.add(spec.function)
            try:
                await self._make_room(stage.param_bytes, {spec.function}, evict_pinned)
                z = await self.zygotes.spawn(spec, stage)
            finally:
                self._caching.discard(spec.function)
            self._write_state()
            return z

    async def start_replicas(self, spec: StageSpec, count: int, mode: str, survive: bool, wait: bool,
                             cache: bool, cold: bool = False, peers: Sequence[str] = (),
                             live: bool = False, unix: bool = False, layers: tuple[int, int] | None = None
                             ) -> list[Replica]:
        """Fork ``count`` replicas from the stage's zygote, or cold-start them when it has none (and cache the stage
        when ``cache``). ``cold``: always cold-start, never touching the cache (a function deployed without the
        KeysManager, ``com.quart.keysmanager: off``). ``live``: a registry stage not yet local starts serving
        the layers that arrived while its file is still arriving (``keysmanager.live``). ``unix``: each serves
        on a Unix socket beside the API socket (``ReplicaInfo.socket``), not on a TCP port: a stage pod forwards
        to it (``quart_stage.forward``). ``layers`` (a part of the stage, absolute): such a stage fetches that
        part first and serves it at once, then the rest (``keysmanager.parts``, ParaServe); a stage already
        local starts whole."""
        requested_at = time.monotonic()
        if not cold and (live or layers is not None):
            started = await self.start_live(spec, count, survive, peers, layers, requested_at)
            if started is not None:
                return await self.started(started, wait)
        spec = await self.localize(spec, peers)
        stage = self._resolve(spec)
        self.replicas.check_free_slots(count)
        z = None if cold else self.zygotes.get(spec.function)
        if z is not None and z.alive and z.stage.fingerprint != stage.fingerprint:
            await self.zygotes.drop(z, "checkpoint or environment changed")
            z = None
        if z is not None and z.ready is not None and not z.ready.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(z.ready)  # being cached right now: wait, then fork
        started: list[Replica] = []
        if z is not None and z.loaded:
            started = await self.fork(z, spec, count, mode, survive, unix, requested_at)
        else:
            for _ in range(count):
                started.append(self.replicas.spawn_cold(spec, stage, mode, survive, requested_at, unix))
            if cache and not cold:
                self.spawn_task(self._cache_quietly(spec))
        for rep in started:
            rep.layers = stage.layers
        return await self.started(started, wait)

    async def start_live(self, spec: StageSpec, count: int, survive: bool, peers: Sequence[str] = (),
                         layers: tuple[int, int] | None = None, requested_at: float | None = None
                         ) -> list[Replica] | None:
        """Start ``count`` replicas of a registry stage not yet local that serve the layers (of the part
        ``layers``, ParaServe) that have arrived while the rest load; None when there is nothing to load live (not
        a registry stage, local already, no per-layer hashes): the caller takes the ordinary path."""
        requested_at = time.monotonic() if requested_at is None else requested_at
        self.replicas.check_free_slots(count)
        found = (await self.localizer.start_part(spec, layers, peers) if layers is not None
                 else await self.localizer.start_live(spec, peers))
        if found is None:
            return None
        return await start_live(self.zygotes, self.replicas, spec, *found, count, survive, requested_at)

    async def fork(self, z: Zygote, spec: StageSpec, count: int, mode: str, survive: bool, unix: bool = False,
                   requested_at: float | None = None) -> list[Replica]:
        """Fork ``count`` replicas from the loaded zygote ``z``."""
        requested_at = time.monotonic() if requested_at is None else requested_at
        z.last_used = time.monotonic()
        started = [await self.replicas.fork(self.zygotes, z, spec, mode, survive, requested_at, unix)
                   for _ in range(count)]
        for rep in started:
            rep.layers = z.stage.layers
        return started

    def cached(self, function: str) -> Zygote | None:
        """The stage's zygote when it is alive and loaded (a fork from it needs no load), else None."""
        z = self.zygotes.get(function)
        return z if z is not None and z.alive and z.loaded else None

    async def started(self, started: list[Replica], wait: bool) -> list[Replica]:
        self._state.touch()
        self._write_state()  # before answering: a restart must know these processes even if we die now
        waits = [self.spawn_task(self.replicas.await_ready(r)) for r in started]
        if wait and waits:
            await asyncio.gather(*waits)
        return started

    async def _cache_quietly(self, spec: StageSpec) -> None:
        """Cache what a cold start just loaded, unless that would displace a pinned (key-stage) zygote."""
        with contextlib.suppress(ManagerError):
            await self.ensure_cached(spec, evict_pinned=False)

    async def stop(self, rid: str, drain: bool) -> Replica:
        return await self.replicas.stop(rid, drain)

    def resize(self, rid: str, cpus: float) -> Replica:
        return self.replicas.resize(rid, cpus)

    def pin(self, functions: list[str], sole: list[str] | None = None) -> list[str]:
        """Replace the set of pinned stages (the scheduler's ``keep_cached`` for this host); returns it sorted.
        A pin stops a key stage's zygote from being traded for another zygote; it does not stop the host
        getting back under its memory limit (pinned zygotes are then evicted last). ``sole``, when given,
        replaces the stages this host alone holds in the cluster (evicted after every duplicate)."""
        self.pinned = set(functions)
        if sole is not None:
            self.sole = set(sole)
        return sorted(self.pinned)

    async def invalidate(self, function: str) -> bool:
        """Drop the stage's zygote (its replicas keep serving); False when it was not cached."""
        z = self.zygotes.get(function)
        if z is not None:
            await self.zygotes.drop(z, "invalidated")
        return z is not None

    # ---------------------------------------------------------------- monitoring
    def _reap(self) -> None:
        """Reap every ended child or orphan re-parented to us (we are a subreaper)."""
        for pid, code in sysutil.reap_children():
            self.zygotes.child_exited(pid, code)
            self.replicas.exited(pid, code)

    async def _monitor_loop(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self.config.monitor_interval_s)
            tick += 1
            try:
                self._reap()
                if tick % 5 == 0:
                    self.replicas.check_liveness(self.zygotes.reports_exit_of)
                if tick % 10 == 0:
                    await self.zygotes.drop_changed()
                    if self.memory_used() > self.memory_limit():
                        with contextlib.suppress(ManagerError):
                            await self._make_room(0, set())
                self._write_state()
            except Exception as exc:  # the monitor must survive anything; say what happened
                print(f"keysmanager {self.name}: monitor error: {exc!r}", file=sys.stderr, flush=True)

    def spawn_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` as a task this agent keeps (and cancels at close)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---------------------------------------------------------------- views
    def replica_info(self, rep: Replica, memory: bool = True) -> ReplicaInfo:
        rss, pss = sysutil.memory_of(rep.pid) if memory and rep.state != "dead" else (0, 0)
        held = held_of(rep)
        return ReplicaInfo(id=rep.id, function=rep.function, host=self.name, pid=rep.pid, port=rep.port,
                           url=f"http://{self.config.host_address}:{rep.port}", state=rep.state, source=rep.source,
                           ready_ms=rep.ready_ms, rss_bytes=rss, pss_bytes=pss, mode=rep.mode,
                           survive=rep.survive, gpu_slot=rep.gpu_slot, exit_status=rep.exit_status,
                           layers=list(rep.layers) if rep.layers else None,
                           layers_held=list(held) if held else None,
                           live=rep.progress is not None and held != rep.layers, socket=rep.socket,
                           phases_ms={k: round(1e3 * (t - rep.requested_at), 1) for k, t in rep.phases.items()}
                           or None)

    def replica_infos(self, function: str | None = None, memory: bool = True) -> list[ReplicaInfo]:
        """Every replica kept (live and recently dead), of ``function`` when given."""
        return [self.replica_info(r, memory) for r in self.replicas.by_id.values()
                if function is None or r.function == function]

    def zygote_info(self, z: Zygote, memory: bool = True) -> ZygoteInfo:
        rss, pss = sysutil.memory_of(z.pid) if memory else (0, 0)
        return ZygoteInfo(function=z.function, pid=z.pid, param_bytes=z.segment.nbytes, sha256=z.stage.sha256,
                          shm_path=str(z.segment.path), load_ms=z.load_ms, last_used=z.last_used,
                          live_replicas=len(self.replicas.live(z.function)), threads=z.threads,
                          rss_bytes=rss, pss_bytes=pss)

    def attach_info(self, z: Zygote) -> dict[str, Any]:
        """What a process outside this agent (a stage pod) needs to map ``z``'s segment: ``POST /v1/attach``.
        Such a mapping is not counted in ``memory_used``: the pages stay while it maps them, even after eviction."""
        if z.index is None:
            raise InvalidSpec(f"stage {z.function!r} holds no parameters: there is no segment to attach", "spec")
        manifest = json.loads((Path(z.stage.env["QUART_MODEL_DIR"]) / MANIFEST).read_text())
        return {"function": z.function, "sha256": z.stage.sha256, "param_bytes": z.segment.nbytes,
                "segment": z.index, "manifest": manifest}

    def zygote_infos(self) -> list[ZygoteInfo]:
        return [self.zygote_info(z) for z in self.zygotes.alive()]

    def report(self) -> HostReport:
        cached = sorted(z.function for z in self.zygotes.by_function.values() if z.loaded)
        return HostReport(name=self.name, cached=cached, memory_used=self.memory_used(),
                          memory_limit=self.memory_limit(), gpu_slots=self.config.gpus,
                          gpu_used=len(self.replicas.slots_used), replicas=len(self.replicas.live()),
                          host_memory_percent=psutil.virtual_memory().percent,
                          held=sorted(f for f, stage in self.localizer.files.items() if stage.complete))
