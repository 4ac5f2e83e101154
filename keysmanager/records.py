"""What the KeysManager keeps about its processes: parameter segments, zygotes, replicas."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from keysmanager.stage import StageRef


@dataclass(eq=False)
class Segment:
    """A shared-memory parameter segment and who still maps it (for memory accounting)."""

    path: Path
    nbytes: int
    zygote_alive: bool = True
    users: set[str] = field(default_factory=set)  # replica ids forked from it


class Segments:
    """Every segment still held, by path: one per zygote, kept while a replica forked from it maps it."""

    def __init__(self) -> None:
        self.by_path: dict[Path, Segment] = {}

    def add(self, path: Path, nbytes: int) -> Segment:
        segment = self.by_path[path] = Segment(path, nbytes)
        return segment

    def release(self, segment: Segment, user: str) -> None:
        """Replica ``user`` no longer maps ``segment``."""
        segment.users.discard(user)
        self._forget_if_unused(segment)

    def orphan(self, segment: Segment) -> None:
        """Its zygote is gone: the name goes now, replicas keep their mappings."""
        segment.zygote_alive = False
        segment.path.unlink(missing_ok=True)
        self._forget_if_unused(segment)

    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self.by_path.values() if s.zygote_alive or s.users)

    def unlink_all(self) -> None:
        for segment in self.by_path.values():
            segment.path.unlink(missing_ok=True)

    def _forget_if_unused(self, segment: Segment) -> None:
        if not segment.users and not segment.zygote_alive:
            self.by_path.pop(segment.path, None)


@dataclass(eq=False)
class ForkedProc:
    """A zygote forked by the preloader: not our child, so its exit status arrives as a message."""

    pid: int
    returncode: int | None = None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)


@dataclass(eq=False)
class Zygote:
    """A cached stage: the process holding its parameters in ``segment``, and its control channel."""

    function: str
    stage: StageRef
    proc: subprocess.Popen | ForkedProc
    segment: Segment
    writer: asyncio.StreamWriter | None = None
    ready: asyncio.Future | None = None
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    load_ms: float = 0.0
    threads: int = 0
    last_used: float = 0.0
    alive: bool = True
    index: dict | None = None  # the segment's tensor index as the zygote reported it (quart_stage.segment)
    phases: dict[str, float] = field(default_factory=dict)  # the zygote's own start phases (monotonic times)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def loaded(self) -> bool:
        """Alive and done loading its parameters without an error."""
        return self.alive and self.ready is not None and self.ready.done() and not self.ready.exception()


@dataclass(eq=False)
class Replica:
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
    segment: Segment | None = None
    proc: subprocess.Popen | None = None  # cold replicas only (our direct children)
    create_time: float = 0.0
    state: str = "starting"
    ready_ms: float | None = None
    exit_status: int | None = None
    dead_at: float | None = None
    adopted: bool = False
    param_bytes: int = 0
    socket: str | None = None  # the Unix socket it serves on (started with listen=unix), else None
    leased: bool = False  # a holder tied its life to a lease (POST /v1/replicas/{id}/lease)
    died: asyncio.Event = field(default_factory=asyncio.Event)
    layers: tuple[int, int] | None = None  # the stage's layer range [S, E) (None: no manifest, no layer list)
    progress: str | None = None  # a live replica's progress file (keysmanager.live): the layers verified so far
    phases: dict[str, float] = field(default_factory=dict)  # start phase → monotonic time it ended (diagnostics)
