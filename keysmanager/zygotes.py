"""The zygotes: one process per cached stage holding its parameters in shared memory, and their preloader.

A zygote is forked by the *preloader* (a fork server that imported torch & co once) when there is one,
else started as a fresh interpreter. The KeysManager talks to each over a socketpair (JSON lines,
``keysmanager.protocol``): ``ready``/``failed`` once loaded, ``fork`` orders answered ``forked``/``error``,
``exited`` reports of the replicas it forked and reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import subprocess
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keysmanager.aio import within
from keysmanager.config import KeysManagerConfig
from keysmanager.errors import StartFailed
from keysmanager.launcher import Launcher
from keysmanager.protocol import encode
from keysmanager.records import ForkedProc, Replica, Segments, Zygote
from keysmanager.stage import StageRef, UnknownStage, resolve_stage
from keysmanager.types import StageSpec

SpawnTask = Callable[[Coroutine[Any, Any, Any]], asyncio.Task]


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
    warm: bool = False  # it imported every family's model code (``keysmanager.zygote.warm_up_modules``)


class Zygotes:
    """The cached stages by function. ``reap`` collects ended children (used while a zygote exits);
    ``on_replica_exit(pid, status)`` receives a zygote's report of a fork it reaped."""

    def __init__(self, config: KeysManagerConfig, launcher: Launcher, segments: Segments, spawn_task: SpawnTask,
                 reap: Callable[[], None], on_replica_exit: Callable[[int, int], None],
                 changed: Callable[[], None]) -> None:
        self.config = config
        self.launcher = launcher
        self.segments = segments
        self.by_function: dict[str, Zygote] = {}
        self.procs: list[subprocess.Popen | ForkedProc] = []  # zygotes (and the preloader) still running
        self._spawn_task = spawn_task
        self._reap = reap
        self._on_replica_exit = on_replica_exit
        self._changed = changed  # the state file must be rewritten
        self._logs = config.state_path / "logs"
        self._preloader: _Preloader | None = None
        self._generation = 0
        self._order_ids = itertools.count(1)

    def get(self, function: str) -> Zygote | None:
        return self.by_function.get(function)

    def alive(self) -> list[Zygote]:
        return [z for z in self.by_function.values() if z.alive]

    def reports_exit_of(self, rep: Replica) -> bool:
        """Whether the zygote that forked ``rep`` is alive (and so reaps it and reports its exit)."""
        z = self.by_function.get(rep.function)
        return rep.source == "fork" and z is not None and z.alive and rep.segment is z.segment

    def child_exited(self, pid: int, status: int) -> None:
        """A reaped child's status, if it was a zygote or the preloader; forget the ones that ended."""
        for proc in self.procs:
            if proc.pid == pid:
                proc.returncode = status
        self.procs = [p for p in self.procs if p.returncode is None]

    def running(self) -> bool:
        return any(p.returncode is None for p in self.procs)

    # ---------------------------------------------------------------- loading
    async def spawn(self, spec: StageSpec, stage: StageRef, register: bool = True) -> Zygote:
        """Start the stage's zygote and wait until its parameters are loaded (raises StartFailed).
        ``register=False``: a zygote that is not the stage's cache (a live start's, ``keysmanager.live``)."""
        self._generation += 1
        safe = spec.function.replace("/", "_")
        shm_path = Path(self.config.shm_dir) / f"{self.config.shm_prefix}{safe}-{self._generation}"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log_path = self._logs / f"zygote-{safe}-{self._generation}.log"
        env = {**self.launcher.child_env(), **spec.env}
        proc: subprocess.Popen | ForkedProc | None = await self._spawn_via_preloader(theirs, env, shm_path, log_path)
        if proc is None:  # no preloader (disabled, starting, or failed): a fresh interpreter
            proc = self.launcher.popen(["--control-fd", str(theirs.fileno()), "--shm-path", str(shm_path)],
                                       env, log_path, (theirs.fileno(),))
        theirs.close()
        self.procs.append(proc)
        segment = self.segments.add(shm_path, stage.param_bytes)
        z = Zygote(spec.function, stage, proc, segment, last_used=time.monotonic())
        z.ready = asyncio.get_running_loop().create_future()
        reader, z.writer = await asyncio.open_unix_connection(sock=ours)
        self._spawn_task(self._zygote_reader(z, reader))
        if register:
            self.by_function[spec.function] = z
        self._changed()
        try:
            hello = await within(self.config.zygote_timeout_s, asyncio.shield(z.ready))
        except asyncio.CancelledError:
            await self.drop(z, "start cancelled")
            raise
        except (TimeoutError, RuntimeError) as exc:
            await self.drop(z, "failed to load")
            raise StartFailed(f"the zygote of {spec.function!r} did not load its parameters: {exc}. "
                              f"Log tail: {_tail(log_path)}", "spec") from None
        z.load_ms = float(hello.get("load_ms", 0.0))
        z.threads = int(hello.get("threads", 0))
        z.index = hello.get("index")
        z.phases = {k: float(v) for k, v in (hello.get("phases") or {}).items()}
        segment.nbytes = int(hello.get("param_bytes", stage.param_bytes))
        return z

    async def start_preloader(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = self.launcher.popen(["--preloader", "--control-fd", str(theirs.fileno())], self.launcher.child_env(),
                                   self._logs / "preloader.log", (theirs.fileno(),))
        theirs.close()
        self.procs.append(proc)
        pre = _Preloader(proc, ours, asyncio.get_running_loop().create_future(), started_at=time.monotonic())
        reader, pre.writer = await asyncio.open_unix_connection(sock=ours)
        self._preloader = pre
        self._spawn_task(self._preloader_reader(pre, reader))

    def preloader_state(self) -> str:
        """``off`` (none, or it exited), ``starting`` (importing torch & co), ``ready`` (forks zygotes; still
        importing model code while idle) or ``warm`` (every family's model code imported)."""
        pre = self._preloader
        if pre is None or not pre.alive:
            return "off"
        if not pre.ready.done():
            return "starting"
        return "warm" if pre.warm else "ready"

    def stop_preloader(self) -> None:
        if self._preloader is not None and self._preloader.alive:
            with contextlib.suppress(OSError):
                self._preloader.sock.send(encode({"op": "exit"}))

    async def _preloader_reader(self, pre: _Preloader, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                op = msg.get("op")
                if op == "ready" and not pre.ready.done():
                    pre.ready.set_result(msg)
                elif op == "failed" and not pre.ready.done():
                    pre.ready.set_exception(RuntimeError(msg.get("error", "failed")))
                elif op == "warm":
                    pre.warm = True
                elif op in ("spawned", "error"):
                    _answer(pre.pending, msg)
                elif op == "exited":
                    for proc in self.procs:
                        if isinstance(proc, ForkedProc) and proc.pid == msg["pid"]:
                            proc.returncode = int(msg["status"])
        except (ConnectionError, ValueError):
            pass
        finally:
            pre.alive = False
            if not pre.ready.done():
                pre.ready.set_exception(RuntimeError("the preloader exited"))
            if not pre.ready.cancelled():
                pre.ready.exception()  # retrieved: a failed preloader only means zygotes start fresh
            _fail_pending(pre.pending, "the preloader exited")

    async def _spawn_via_preloader(self, theirs: socket.socket, env: dict[str, str], shm_path: Path,
                                   log_path: Path) -> ForkedProc | None:
        """Fork a zygote from the preloader; None when there is no usable preloader (the caller spawns one)."""
        pre = self._preloader
        if pre is None or not pre.alive:
            if self.config.preload and (pre is None or time.monotonic() - pre.started_at > 30.0):
                await self.start_preloader()  # ready for the next stage; this one starts fresh
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
        proc = ForkedProc(int(answer["pid"]))
        self.procs.append(proc)
        return proc

    # ---------------------------------------------------------------- the control channel
    async def fork(self, z: Zygote, order: dict[str, Any]) -> dict[str, Any]:
        """Send a ``fork`` order; the zygote's answer (``forked`` with pid and port, or ``error``)."""
        order_id = next(self._order_ids)
        fut = asyncio.get_running_loop().create_future()
        z.pending[order_id] = fut
        assert z.writer is not None
        z.writer.write(encode({"op": "fork", "id": order_id, **order}))
        await z.writer.drain()
        return await within(30.0, fut)

    async def _zygote_reader(self, z: Zygote, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                op = msg.get("op")
                if op == "ready" and z.ready and not z.ready.done():
                    z.ready.set_result(msg)
                elif op == "failed" and z.ready and not z.ready.done():
                    z.ready.set_exception(RuntimeError(msg.get("error", "failed")))
                elif op in ("forked", "error"):
                    _answer(z.pending, msg)
                elif op == "exited":
                    self._on_replica_exit(int(msg["pid"]), int(msg["status"]))
        except (ConnectionError, ValueError):
            pass
        finally:
            z.alive = False
            if z.ready and not z.ready.done():
                z.ready.set_exception(RuntimeError("the zygote exited"))
            _fail_pending(z.pending, "the zygote exited")
            z.pending.clear()
            if self.by_function.get(z.function) is z:
                self._forget(z)

    # ---------------------------------------------------------------- dropping
    def _forget(self, z: Zygote) -> None:
        z.alive = False
        if self.by_function.get(z.function) is z:
            del self.by_function[z.function]
        self.segments.orphan(z.segment)
        self._changed()

    async def drop(self, z: Zygote, reason: str) -> None:
        """Stop a zygote (its replicas keep serving) and release its segment's name."""
        self._forget(z)
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

    async def drop_all(self, reason: str) -> None:
        for z in list(self.by_function.values()):
            await self.drop(z, reason)

    async def drop_changed(self) -> None:
        """Invalidation: drop a zygote whose stage file or manifest changed (sha256 in the manifest)."""
        for z in list(self.by_function.values()):
            if not z.alive or z.ready is None or not z.ready.done():
                continue
            try:
                current = resolve_stage(z.function, z.stage.env)
            except (UnknownStage, ValueError):
                await self.drop(z, "stage checkpoint removed")
                continue
            if current.fingerprint != z.stage.fingerprint:
                await self.drop(z, "checkpoint changed")


def _answer(pending: dict[int, asyncio.Future], msg: dict[str, Any]) -> None:
    fut = pending.pop(msg.get("id"), None)
    if fut and not fut.done():
        fut.set_result(msg)


def _fail_pending(pending: dict[int, asyncio.Future], error: str) -> None:
    for fut in pending.values():
        if not fut.done():
            fut.set_result({"op": "error", "error": error})


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return "(no log)"
