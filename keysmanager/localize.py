"""A stage deployed from the model registry (``QUART_MODEL_URL``), made local on this host: once per host,
from a peer KeysManager that holds it (BlitzScale's peer fetch, ``keysmanager.peers``) or else from the
registry, into ``<state_dir>/registry/<key>/``; then it loads as from any folder.

The manifest comes from the registry even when the bytes come from a peer: the registry is the authority on
what the stage's bytes must be, so a peer holding an older generation or corrupt bytes is caught by the
sha256 check at every hop; the token only says that the peer belongs to the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from keysmanager.errors import InvalidSpec, RegistryUnavailable
from keysmanager.landing import LandingReserve
from keysmanager.parts import HeaderFailed, PartError, PartJob, fetch_part
from keysmanager.peers import StageFile, read_peer_range, stream_from_peer
from keysmanager.registry import LIVE_MANIFEST, MANIFEST, MODEL_URL_ENV, ModelRegistry, RegistryError
from keysmanager.transfer import FetchResult, TransferError, VerifiedWriter
from keysmanager.types import StageSpec


@dataclass(frozen=True, slots=True)
class LiveTarget:
    """A stage file still arriving, as a live replica maps it: the folder (tokenizer, ``LIVE_MANIFEST``), the
    pre-sized partial file, the progress file (layers verified) and the number of the stage's layers."""

    folder: Path
    stage_index: int
    partial: Path
    progress: Path
    manifest: Path
    layers: int
    marks: dict[str, float] = field(default_factory=dict)  # the start's timeline (``PartJob.marks`` for a part)


class Localizer:
    """Local folders of registry stages, the transfers in flight, and what this host can serve to peers."""

    def __init__(self, state_dir: Path, token: str | None, landing: LandingReserve | None = None) -> None:
        self.root = Path(state_dir) / "registry"
        self.landing = landing  # pre-touched pages the next new stage file lands in (keysmanager.landing)
        self.token = token  # the cluster's bearer token, to fetch from peers
        self.files: dict[str, StageFile] = {}  # function → its stage file here (complete or arriving)
        self.fetched: dict[str, FetchResult] = {}  # function → how its last transfer went
        self.timelines: dict[str, dict[str, float]] = {}  # function → its last live or part start's marks (wall clock)
        self.active: set[str] = set()  # functions being made local now (a peer asking for one waits for its bytes)
        self._locks: dict[Path, asyncio.Lock] = {}
        self._registries: dict[str, ModelRegistry] = {}  # one client per model URL (boto3 clients are thread-safe)
        self._tasks: set[asyncio.Task] = set()
        self.part_read_timeout_s = 10.0  # a part start's ranged read from a peer (KeysManagerConfig)

    def folder(self, spec: StageSpec) -> Path:
        url = spec.env[MODEL_URL_ENV]
        index = spec.env.get("QUART_STAGE_INDEX", "0")
        return self.root / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{index}"

    async def localize(self, spec: StageSpec, peers: Sequence[str] = (), live: bool = False) -> StageSpec:
        """``spec`` with its local ``QUART_MODEL_DIR``: fetched once per host, however many starts ask at once,
        from the first of ``peers`` that delivers verified bytes, else from the registry (in a worker thread).
        Raises RegistryUnavailable naming every cause. ``live``: check the file layer by layer as it arrives
        (``start_live``)."""
        if not _from_registry(spec):
            return spec
        folder = self.folder(spec)
        self.active.add(spec.function)
        try:
            async with self._locks.setdefault(folder, asyncio.Lock()):
                if not (folder / MANIFEST).exists():
                    await self._fetch(spec, folder, list(peers), live)
        finally:
            self.active.discard(spec.function)
        return replace(spec, env={**spec.env, "QUART_MODEL_DIR": str(folder)})

    def prefetch(self, spec: StageSpec, peers: Sequence[str] = ()) -> None:
        """Start localizing in the background (a chain's receivers are told in order: each one's transfer is
        registered here before the next host asks it for the bytes)."""
        if _from_registry(spec):
            self.active.add(spec.function)  # before answering: the next host of a chain may ask at once
        task = asyncio.create_task(self._quietly(spec, peers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _quietly(self, spec: StageSpec, peers: Sequence[str]) -> None:
        # checked layer by layer (when the manifest can): a live start on this host attaches to this transfer
        with contextlib.suppress(RegistryUnavailable, InvalidSpec):
            await self.localize(spec, peers, live=True)

    async def start_live(self, spec: StageSpec, peers: Sequence[str] = ()) -> tuple[LiveTarget, asyncio.Task] | None:
        """Start making a registry stage local with per-layer checks, and answer as soon as its writer is open:
        where the file fills (``LiveTarget``) and the transfer's task. None when there is nothing to do live: not a
        registry stage, already local, a manifest without per-layer hashes, or a transfer that ended before
        (the caller then takes the ordinary path, which reports any error)."""
        if not _from_registry(spec) or (self.folder(spec) / MANIFEST).exists():
            return None
        function, folder = spec.function, self.folder(spec)
        self.active.add(function)
        marks = self.timelines[function] = {"requested": time.time()}
        task = asyncio.create_task(self.localize(spec, peers, live=True))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: the caller reports it
        while not task.done():
            stage = self.files.get(function)
            writer = stage.writer if stage is not None else None
            if writer is not None and writer.layers is not None and writer.state == "writing":
                index = int(spec.env.get("QUART_STAGE_INDEX", "0"))
                marks.setdefault("writer_open", time.time())
                return LiveTarget(folder, index, writer.partial, writer.layers.progress, folder / LIVE_MANIFEST,
                                  len(writer.layers.spans), marks), task
            await asyncio.sleep(0.002)
        return None

    async def start_part(self, spec: StageSpec, layers: tuple[int, int], peers: Sequence[str] = ()
                         ) -> tuple[LiveTarget, asyncio.Task] | None:
        """Start making a registry stage local part first (``keysmanager.parts``: the layers ``layers``, then the
        rest) and answer once its partial file and progress file exist: where it fills and the fetch's task. None
        when the stage is not from the registry or already local. InvalidSpec for a part outside the stage or a
        manifest without per-layer hashes; RegistryUnavailable when even the header cannot be fetched."""
        if not _from_registry(spec) or (self.folder(spec) / MANIFEST).exists():
            return None
        job = PartJob()
        job.mark("requested")
        self.timelines[spec.function] = job.marks
        task = asyncio.create_task(self._fetch_part(spec, layers, list(peers), job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: the caller reports it
        while not task.done():
            if job.opened.is_set() and job.partial is not None:
                index = int(spec.env.get("QUART_STAGE_INDEX", "0"))
                return LiveTarget(self.folder(spec), index, job.partial, job.progress,
                                  self.folder(spec) / LIVE_MANIFEST, job.layers, job.marks), task
            await asyncio.sleep(0.002)
        task.result()  # raises what ended it
        return None

    async def _fetch_part(self, spec: StageSpec, layers: tuple[int, int], peers: list[str], job: PartJob) -> None:
        function, folder = spec.function, self.folder(spec)
        async with self._locks.setdefault(folder, asyncio.Lock()):
            if (folder / MANIFEST).exists():
                return
            try:
                stage_index = int(spec.env.get("QUART_STAGE_INDEX", "0"))
            except ValueError:
                raise InvalidSpec("QUART_STAGE_INDEX must be an integer", "spec.env") from None
            url = spec.env[MODEL_URL_ENV]
            registry = self._registries.get(url) or self._registries.setdefault(url, ModelRegistry(url))
            readers = [(f"peer {p}", partial(read_peer_range, p, function, self.token, None,
                                             read_timeout_s=self.part_read_timeout_s)) for p in peers]
            try:
                result = await asyncio.to_thread(fetch_part, registry, stage_index, folder, layers, readers, job)
            except PartError as exc:
                raise InvalidSpec(str(exc), exc.field) from None
            except (TransferError, OSError, HeaderFailed) as exc:  # the registry's errors too
                raise RegistryUnavailable(f"stage {function!r} (part {layers[0]}-{layers[1]}): {exc}",
                                          "spec.env." + MODEL_URL_ENV) from None
            self.fetched[function] = result
            self._note_folder(function, folder, stage_index)

    async def _fetch(self, spec: StageSpec, folder: Path, peers: list[str], live: bool = False) -> None:
        index = spec.env.get("QUART_STAGE_INDEX", "0")
        try:
            stage_index = int(index)
        except ValueError:
            raise InvalidSpec(f"QUART_STAGE_INDEX must be an integer, got {index!r}", "spec.env") from None
        function = spec.function

        def on_writer(writer: VerifiedWriter) -> None:  # runs in the worker thread as each attempt opens
            self.files[function] = StageFile(function, writer.dest, writer.sha256 or "", writer.size or 0, writer)

        sources = [(f"peer {p}", partial(stream_from_peer, p, function, self.token)) for p in peers]
        url = spec.env[MODEL_URL_ENV]
        registry = self._registries.get(url) or self._registries.setdefault(url, ModelRegistry(url))
        self.files.pop(function, None)
        try:
            result = await asyncio.to_thread(registry.materialize, stage_index, folder, peers=sources,
                                             on_writer=on_writer, live=live, landing=self.landing)
        except RegistryError as exc:
            self.files.pop(function, None)
            raise RegistryUnavailable(f"stage {function!r}: {exc}", "spec.env." + MODEL_URL_ENV) from None
        finally:
            if self.landing is not None:
                self.landing.refill_later()
        self.fetched[function] = result
        done = self.files.get(function)
        if done is not None:
            self.files[function] = replace(done, writer=None)
        else:  # already here from an earlier run of this state dir
            self._note_folder(function, folder, stage_index)

    async def wait_file(self, function: str, timeout_s: float = 10.0) -> StageFile | None:
        """The stage file once a transfer of ``function`` that is starting here opens it; None when none is
        starting, or it does not open within ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while function in self.active and asyncio.get_running_loop().time() < deadline:
            stage = self.files.get(function)
            if stage is not None and (stage.writer is None or stage.writer.state != "failed"):
                return stage
            await asyncio.sleep(0.005)
        return self.files.get(function)

    def _note_folder(self, function: str, folder: Path, stage_index: int) -> None:
        from quart_stage.manifest import Manifest, stage_path

        with contextlib.suppress(FileNotFoundError, ValueError, KeyError, IndexError, TypeError):
            entry = Manifest.load(folder).stage(stage_index)
            if entry.file is not None:
                path = Path(stage_path(folder, entry.file))  # never outside the folder
                self.files[function] = StageFile(function, path, entry.sha256 or "", path.stat().st_size)

    def status(self, function: str) -> dict:
        """What this host has of ``function``'s file: ``held``, ``fetching`` (bytes so far) or ``absent``."""
        stage = self.files.get(function)
        last = self.fetched.get(function)
        info: dict = {"function": function, "state": "absent"}
        if stage is not None:
            info.update(state="held" if stage.complete else "fetching", size=stage.size, sha256=stage.sha256,
                        bytes=stage.size if stage.complete else stage.writer.written)
        if last is not None:
            info.update(source=last.source, seconds=round(last.seconds, 4), finished_at=last.finished_at)
        if function in self.timelines:
            info["timeline"] = dict(self.timelines[function])
        return info


def _from_registry(spec: StageSpec) -> bool:
    return spec.env.get(MODEL_URL_ENV) is not None and not spec.env.get("QUART_MODEL_DIR")
