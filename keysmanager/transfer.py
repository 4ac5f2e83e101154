"""The one way a stage's bytes land on a host: streamed in file order into ``<dest>.partial``, hashed as they
arrive, checked against the manifest's size and sha256, then renamed into place. The registry
(``keysmanager.registry``) and peers (``keysmanager.peers``) both write through :class:`VerifiedWriter`, so
nothing half-fetched or corrupt is ever where a zygote could load it.

While a transfer runs, ``written`` says how many bytes of the partial file are on disk: a KeysManager serves
them on to the next host of a chain (``keysmanager.peers.serve_file``) before the transfer ends.

Live (``layers`` given, a :class:`LayerCheck`): the partial file is pre-sized (so a replica can map it while it
fills), each layer's bytes are hashed as they arrive and, once a layer's sha256 matches the manifest, the
progress file is raised to the number of layers verified (``quart_stage.progress``). A layer that does not
match ends the attempt (TransferError: the next source is tried). A later attempt keeps the partial file (a
live replica maps it) and never rewrites bytes of layers already verified: it only hashes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quart_stage.progress import read_progress, write_progress

if TYPE_CHECKING:
    from keysmanager.landing import LandingReserve

CHUNK_BYTES = 4 << 20

Progress = Callable[[int, int], None]  # (bytes so far, total bytes)


@dataclass(frozen=True, slots=True)
class LayerCheck:
    """Per-layer integrity of one stage file: byte ranges ``[offset, end)`` tiling the file in layer order, their
    sha256, and the progress file to raise as each one verifies."""

    spans: tuple[tuple[int, int], ...]
    sha256: tuple[str, ...]
    progress: Path


class TransferError(RuntimeError):
    """A transfer did not give the bytes the manifest names (short, long, checksum mismatch) or broke off."""


@dataclass(frozen=True, slots=True)
class FetchResult:
    path: Path
    nbytes: int
    seconds: float
    source: str = "registry"  # where the bytes came from: "registry" or a peer's URL
    finished_at: float = field(default_factory=time.time)  # wall clock when the verified file was in place

    @property
    def gbps(self) -> float:
        return 8 * self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class VerifiedWriter:
    """Write one object in order into ``dest`` (via ``dest.partial``) and verify it on :meth:`commit`.

    ``with VerifiedWriter(dest, sha256, size, what="s3://m/stage-0") as w: w.write(chunk) ...; w.commit()``;
    leaving the block without a commit removes the partial file. ``state`` is ``writing``, ``done`` or
    ``failed``; readers of a transfer in flight follow ``written`` (thread-safe to read).
    """

    def __init__(self, dest: Path, sha256: str | None = None, size: int | None = None, what: str = "",
                 on_progress: Progress | None = None, layers: LayerCheck | None = None,
                 landing: LandingReserve | None = None) -> None:
        self.dest = Path(dest)
        self.partial = self.dest.with_name(self.dest.name + ".partial")
        self.sha256, self.size, self.what = sha256, size, what or str(dest)
        self.on_progress = on_progress
        self.written = 0
        self.state = "writing"
        self.changed = threading.Condition()
        self._digest = hashlib.sha256()
        self._started = time.perf_counter()
        self._file = None
        self.layers = layers
        self._layer = 0  # the layer being hashed now
        self._layer_digest = hashlib.sha256()
        self._keep = 0  # bytes at the start already verified by an earlier attempt: hashed, never rewritten
        # layers that tile the whole file are its checksum: no second sha256 pass over every byte
        self._hash_whole = layers is None or not (layers.spans and layers.spans[0][0] == 0
                                                  and layers.spans[-1][1] == size)
        self._pipe: tuple[int, int] | None = None  # splice_from: socket → pipe → file
        self._map: mmap.mmap | None = None  # ... and the file mapped read-only, to hash what landed in place
        self.landing = landing  # pre-touched pages a new partial file takes (keysmanager.landing)
        self.pretouched = 0  # bytes of the partial file that were touched before this transfer (the reserve's)

    def __enter__(self) -> VerifiedWriter:
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        if self.layers is None:
            # a new file, never a truncated one: a live replica of an earlier attempt may still map the old one
            self.partial.unlink(missing_ok=True)
            self.pretouched = self._take_landing()
            # closed in commit/abort; readable: splice_from maps it; a taken reserve is overwritten from its start
            self._file = open(self.partial, "r+b" if self.pretouched else "w+b")  # noqa: SIM115
            return self
        if not self.partial.exists():  # an earlier attempt's file is kept (a live replica maps it)
            self.pretouched = self._take_landing()
        fd = os.open(self.partial, os.O_RDWR | os.O_CREAT, 0o644)  # never truncated: a live replica maps it
        self._file = os.fdopen(fd, "r+b")
        if self.size is not None and os.fstat(fd).st_size < self.size:
            os.ftruncate(fd, self.size)  # pre-sized: mappable whole; bytes not arrived read as zeros
        done = read_progress(str(self.layers.progress))
        self._keep = self.layers.spans[done - 1][1] if done else 0
        return self

    def _take_landing(self) -> int:
        return self.landing.take(self.partial, self.size) if self.landing is not None and self.size else 0

    def __exit__(self, *exc: object) -> None:
        if self.state == "writing":
            self.abort()

    def write(self, chunk: bytes | memoryview) -> None:
        skip = min(len(chunk), max(0, self._keep - self.written))
        if skip or self._map is not None:  # verified earlier: bytes a live replica may use stay as they are;
            self._file.seek(self.written + skip)  # or splice_from wrote by offset, not through this file's position
        self._file.write(memoryview(chunk)[skip:] if skip else chunk)
        self._file.flush()  # readers of the partial file see what ``written`` says
        self._landed(chunk)

    @property
    def can_splice(self) -> bool:
        """Whether :meth:`splice_from` may take the next bytes: the size is known and they are new (not bytes
        an earlier live attempt verified, which are only hashed, never rewritten)."""
        return bool(self.size) and self.written >= self._keep and self.written < self.size

    def splice_from(self, fd: int, count: int) -> int:
        """Move up to ``count`` bytes from the socket ``fd`` to the file at ``written`` with ``splice`` (socket →
        pipe → page cache: no copy through user space), then hash them from the page cache while they are hot.
        Returns the bytes taken (0: the peer closed). BlockingIOError when a non-blocking socket has nothing."""
        if self._map is None:
            self._open_splice()
        read_end, write_end = self._pipe
        n = os.splice(fd, write_end, min(count, self.size - self.written), flags=os.SPLICE_F_MOVE)
        pos, left = self.written, n
        while left:
            left -= os.splice(read_end, self._file.fileno(), left, offset_dst=pos + n - left, flags=os.SPLICE_F_MOVE)
        if n:
            with memoryview(self._map) as whole, whole[pos:pos + n] as landed:
                self._landed(landed)
        return n

    def _open_splice(self) -> None:
        fd = self._file.fileno()
        if os.fstat(fd).st_size < self.size:
            os.ftruncate(fd, self.size)  # mappable whole; the bytes not arrived read as zeros
        self._pipe = os.pipe()
        with contextlib.suppress(OSError):  # a pipe of 1 MiB: a socket read's worth per splice (default 64 KiB)
            fcntl.fcntl(self._pipe[1], fcntl.F_SETPIPE_SZ, 1 << 20)
        self._map = mmap.mmap(fd, self.size, prot=mmap.PROT_READ)

    def _close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view in a failed layer check's traceback: unmapped with it
                self._map.close()
            self._map = None
        if self._pipe is not None:
            for end in self._pipe:
                os.close(end)
            self._pipe = None
        if self._file is not None and not self._file.closed:
            self._file.close()

    def _landed(self, chunk: bytes | memoryview) -> None:
        """Account for bytes now in the file at ``written``: hash them, verify layers, wake readers."""
        if self._hash_whole:
            self._digest.update(chunk)
        if self.layers is not None:
            self._check_layers(chunk)  # after the write: a layer is announced only once its bytes are on disk
        with self.changed:
            self.written += len(chunk)
            self.changed.notify_all()
        if self.on_progress is not None:
            self.on_progress(self.written, self.size or 0)

    def _check_layers(self, chunk: bytes | memoryview) -> None:
        """Hash ``chunk`` into the layers it covers; raise the progress file as each layer verifies, or raise
        TransferError (nothing of that layer counts as held) when one does not."""
        spans, view, pos = self.layers.spans, memoryview(chunk).cast("B"), self.written
        while len(view) and self._layer < len(spans):
            end = spans[self._layer][1]
            take = min(len(view), end - pos)
            self._layer_digest.update(view[:take])
            view, pos = view[take:], pos + take
            if pos == end:
                if self._layer_digest.hexdigest() != self.layers.sha256[self._layer]:
                    raise TransferError(f"{self.what}: layer {self._layer} of the stage fails its sha256 check "
                                        f"(bytes {spans[self._layer][0]}..{end}); not served, trying the next source")
                if end > self._keep:
                    write_progress(str(self.layers.progress), self._layer + 1)
                self._layer += 1
                self._layer_digest = hashlib.sha256()

    def write_all(self, chunks: Iterable[bytes]) -> FetchResult:
        """Write every chunk, then commit."""
        for chunk in chunks:
            self.write(chunk)
        return self.commit()

    def commit(self, source: str = "registry") -> FetchResult:
        """Verify size and sha256, rename into place; TransferError (partial file removed) when they differ."""
        self._close()
        if self.size is not None and self.written != self.size:
            self.abort()
            raise TransferError(f"{self.what}: got {self.written} bytes, the manifest says {self.size}")
        if not self._hash_whole:
            if self._layer != len(self.layers.spans):  # cannot happen with the size right; kept as a guard
                self.abort()
                raise TransferError(f"{self.what}: {self._layer} of {len(self.layers.spans)} layers verified")
            got = self.sha256
        else:
            got = self._digest.hexdigest()
        if self.sha256 and got != self.sha256:
            self.abort()
            raise TransferError(f"{self.what}: checksum mismatch (sha256 {got[:16]}…, the manifest says "
                                f"{self.sha256[:16]}…); nothing was cached")
        os.replace(self.partial, self.dest)
        self._finish("done")
        return FetchResult(self.dest, self.written, time.perf_counter() - self._started, source)

    def abort(self) -> None:
        self._close()
        if self.layers is None:  # live: kept (a replica maps it; the next attempt resumes on its verified layers)
            self.partial.unlink(missing_ok=True)
        self._finish("failed")

    def _finish(self, state: str) -> None:
        with self.changed:
            self.state = state
            self.changed.notify_all()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


StreamInto = Callable[[VerifiedWriter], FetchResult]  # streams an object into an open writer and commits it


def fetch_first(sources: Sequence[tuple[str, StreamInto]], open_writer: Callable[[], VerifiedWriter]) -> FetchResult:
    """The first source (label, stream) that delivers verified bytes, each tried with a fresh writer; a failed
    one (broken off, wrong bytes) is followed by the next. TransferError naming every failure when none does."""
    failures: list[str] = []
    for label, stream in sources:
        try:
            with open_writer() as writer:
                return stream(writer)
        except (TransferError, OSError) as exc:
            failures.append(f"{label}: {exc}")
    raise TransferError("; ".join(failures) or "no source to fetch from")
