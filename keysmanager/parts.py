"""Part start (ParaServe §5-§6): fetch one part of a stage first, serve it at once, then consolidate.

A start that names a part of its stage (``"layers": [a, b]``, absolute, inside the stage's ``[S, E)``) makes
the stage local out of file order: the layers ``[a, b)`` by one ranged read (a peer KeysManager with
``Range``, else the registry's GetObject ``Range``), each layer hashed against the manifest's
``layer_sha256`` as its bytes stream in and only then announced in the progress file; alongside, the
safetensors header by its own ranged read, verified by the manifest's ``header_sha256`` before any layer is
announced (a manifest without it fetches layer ``S`` first, whose hash covers the header; the first part's
layer ``S`` carries it anyway). The live replica (``keysmanager.live``) serves what of ``[a, b)`` is
announced; the worker then fetches ``[b, E)`` and then ``[S, a)`` (one ranged read each: an object store may
pay per read — moto reads the whole object for each), so the verified range ``[lo, hi)`` stays contiguous
while it grows (the progress file's range format, ``quart_stage.progress``). Once every layer is verified
(the layers tile the file) the file is renamed into place and the manifest written: the folder is complete,
the replica is whole, and later starts take the normal zygote path.

A layer whose bytes fail their sha256 or whose source breaks off is fetched from the next source; when every
source fails the fetch ends (TransferError): what was verified stays served, nothing else ever is, and the
router answers the rest with an explicit error.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from quart_stage.progress import write_range

from keysmanager.registry import LIVE_MANIFEST, MANIFEST, PROGRESS_SUFFIX, ModelRegistry, RegistryError
from keysmanager.transfer import FetchResult, TransferError

RangeRead = Callable[[int, int], Iterator[bytes]]  # (start, end exclusive) → the bytes, in chunks
_ATTEMPTS = itertools.count()


class PartError(ValueError):
    """The part asked for is not a non-empty range inside the stage, or the manifest cannot serve parts."""

    def __init__(self, message: str, field: str = "layers") -> None:
        super().__init__(message)
        self.field = field


class HeaderFailed(RuntimeError):
    """No source gave the header's bytes: nothing of the part can be served."""


@dataclass
class PartJob:
    """What the asyncio side sees of a part fetch running in a worker thread."""

    partial: Path | None = None
    progress: Path | None = None
    layers: int = 0  # the stage's layer count
    opened: threading.Event = field(default_factory=threading.Event)  # partial, progress, live manifest ready
    held: tuple[int, int] = (0, 0)  # the verified range, relative to the stage's first layer
    failures: list[str] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)  # the start's timeline: name → wall clock, first only

    def mark(self, name: str) -> None:
        """Note when ``name`` first happened (wall clock: the hosts' namespaces share it; benchmarks read it)."""
        self.marks.setdefault(name, time.time())


def fetch_order(layers: int, part: tuple[int, int], header_first: bool) -> list[list[int]]:
    """Runs of relative layer indices in fetch order, each run one ranged read: the part, then the layers after
    it, then the layers before it (the verified range stays contiguous around the part); layer 0 alone first
    when it carries the only check of the header. Few reads: an object store may pay per read, not per byte."""
    lo, hi = part
    runs = [list(range(lo, hi)), list(range(hi, layers)), list(range(0, lo))]
    if header_first and lo > 0:
        runs = [[0], runs[0], runs[1], list(range(1, lo))]
    return [r for r in runs if r]


def grow(verified: set[int], part: tuple[int, int]) -> tuple[int, int]:
    """The contiguous verified range around ``part``: empty until the part's first layer is verified."""
    lo = part[0]
    if lo not in verified:
        return 0, 0
    hi = lo
    while hi in verified:
        hi += 1
    while lo - 1 in verified:
        lo -= 1
    return lo, hi


def check_spans(entry: dict) -> list[tuple[int, int]]:
    """The stage's layer byte ranges; PartError unless they tile its file (then all layers verified = the file)."""
    spans, hashes, size = entry.get("layer_bytes"), entry.get("layer_sha256"), entry.get("file_bytes")
    if not entry.get("file") or not spans or not hashes or not size or len(spans) != len(hashes):
        raise PartError("this stage's manifest has no per-layer byte ranges and hashes: it cannot start by parts "
                        "(partition it again)", "spec.env.QUART_MODEL_URL")
    out = [(int(a), int(b)) for a, b in spans]
    if out[0][0] != 0 or out[-1][1] != int(size) or any(x[1] != y[0] for x, y in zip(out, out[1:], strict=False)):
        raise PartError("this stage's layer byte ranges do not tile its file", "spec.env.QUART_MODEL_URL")
    return out


def fetch_part(registry: ModelRegistry, stage_index: int, dest_dir: Path, layers: tuple[int, int],
               peers: Sequence[tuple[str, Callable[[int, int], Iterator[bytes]]]], job: PartJob) -> FetchResult:
    """Make stage ``stage_index`` local in ``dest_dir`` part first (see the module docstring). ``layers``:
    absolute; ``peers``: (label, ranged reader) tried before the registry for every range. Runs in a thread."""
    started = time.perf_counter()
    job.mark("fetch_begin")
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    manifest = registry.manifest()
    stages = manifest.get("stages") or []
    if not 0 <= stage_index < len(stages):
        raise PartError(f"model {manifest.get('model')!r} has stages 0..{len(stages) - 1}, not {stage_index}",
                        "spec.env.QUART_STAGE_INDEX")
    entry = stages[stage_index]
    s, e = int(entry["start"]), int(entry["end"])
    a, b = layers
    if not s <= a < b <= e:
        raise PartError(f"layers [{a}, {b}) are not a non-empty range inside this stage's layers [{s}, {e})")
    spans, hashes = check_spans(entry), list(entry["layer_sha256"])
    part = (a - s, b - s)
    for extra in filter(None, [manifest.get("tokenizer")]):
        if not (dest_dir / extra).exists():
            registry.fetch(extra, dest_dir / extra)
    target = dest_dir / entry["file"]
    partial = target.with_name(target.name + ".partial")
    progress = target.with_name(f"{target.name}.part-{os.getpid()}-{next(_ATTEMPTS)}{PROGRESS_SUFFIX}")
    partial.unlink(missing_ok=True)  # a replica of an earlier attempt keeps its mapping (the inode stays)
    tmp = dest_dir / (LIVE_MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, dest_dir / LIVE_MANIFEST)
    sources = [*peers, (registry.url, lambda x, y: registry.read_range(entry["file"], x, y))]
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    done = False
    try:
        os.ftruncate(fd, int(entry["file_bytes"]))  # pre-sized: mappable whole; bytes not arrived read as zeros
        job.partial, job.progress, job.layers = partial, progress, len(spans)
        # the header alone (its own hash), read while the part streams in (no layer is announced before it is
        # verified); the first part's first layer carries the header itself
        header_ok = part[0] > 0 and bool(entry.get("header_bytes") and entry.get("header_sha256"))
        header_done, header_error = threading.Event(), []
        if header_ok:
            def get_header() -> None:
                try:
                    _fetch_range(fd, sources, 0, int(entry["header_bytes"]), entry["header_sha256"], "the header",
                                 job)
                except BaseException as exc:  # noqa: BLE001 - handed to the fetching thread
                    header_error.append(exc)
                finally:
                    header_done.set()

            threading.Thread(target=get_header, name="part-header", daemon=True).start()
        job.opened.set()
        verified: set[int] = set()

        def announce(k: int) -> None:  # after the layer's bytes are written and match: announced only then
            if header_ok:
                header_done.wait()
                if header_error:
                    raise HeaderFailed(f"the stage file's header: {header_error[0]}")
            verified.add(k)
            held = grow(verified, part)
            if held != job.held and held[1] > held[0]:
                write_range(str(progress), *held)
                job.held = held
                job.mark("first_layer")
                if held[0] <= part[0] and part[1] <= held[1]:
                    job.mark("part_held")

        for run in fetch_order(len(spans), part, part[0] > 0 and not header_ok):
            _fetch_layers(fd, sources, spans, hashes, run, announce, s, job)
        done = True
    finally:
        job.opened.set()
        header_done.wait() if header_ok else None  # its thread writes through fd: close it only after
        os.close(fd)
        if not done:  # a later fetch starts afresh; a replica mapping this one keeps it (the inode stays)
            partial.unlink(missing_ok=True)
    os.replace(partial, target)  # every layer verified and they tile the file: the file is verified
    tmp = dest_dir / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, dest_dir / MANIFEST)  # the folder is complete
    job.mark("whole")
    return FetchResult(target, int(entry["file_bytes"]), time.perf_counter() - started, "registry")


def _fetch_layers(fd: int, sources: Sequence[tuple[str, RangeRead]], spans: list[tuple[int, int]],
                  hashes: list[str], run: list[int], announce: Callable[[int], None], first: int,
                  job: PartJob) -> None:
    """The contiguous layers ``run`` in one ranged read per source, each layer hashed as its bytes stream in and
    announced as soon as it matches; a source that fails (wrong bytes, short, broken off) leaves the layers it
    verified and the next source is asked for the rest."""
    remaining, failures = list(run), []
    for label, read in sources:
        if not remaining:
            return
        start, end = spans[remaining[0]][0], spans[remaining[-1]][1]
        digest, pos = hashlib.sha256(), start
        try:
            for chunk in read(start, end):
                view = memoryview(chunk).cast("B")
                while len(view):
                    if not remaining:
                        raise TransferError(f"sent more than the {end - start} bytes asked for")
                    k = remaining[0]
                    take = min(len(view), spans[k][1] - pos)
                    os.pwrite(fd, view[:take], pos)
                    digest.update(view[:take])
                    pos, view = pos + take, view[take:]
                    if pos == spans[k][1]:
                        if digest.hexdigest() != hashes[k]:
                            raise TransferError(f"layer {first + k} fails its sha256 check; not served")
                        remaining.pop(0)
                        announce(k)
                        digest = hashlib.sha256()
            if remaining:
                raise TransferError(f"sent {pos - start} of {end - start} bytes")
        except (TransferError, RegistryError, OSError) as exc:
            failures.append(f"{label}: {exc}")
            job.failures.append(f"layers {first + run[0]}-{first + run[-1] + 1}: {label}: {exc}")
    if remaining:
        raise TransferError(f"layers {first + remaining[0]}-{first + remaining[-1] + 1}: " + "; ".join(failures))


def _fetch_range(fd: int, sources: Sequence[tuple[str, RangeRead]], start: int, end: int, sha256: str, what: str,
                 job: PartJob) -> None:
    """Bytes ``[start, end)`` written at their offset, from the first source whose bytes match ``sha256``."""
    failures = []
    for label, read in sources:
        digest, pos = hashlib.sha256(), start
        try:
            for chunk in read(start, end):
                if pos + len(chunk) > end:
                    raise TransferError(f"sent more than the {end - start} bytes asked for")
                os.pwrite(fd, chunk, pos)
                digest.update(chunk)
                pos += len(chunk)
            if pos != end:
                raise TransferError(f"sent {pos - start} of {end - start} bytes")
            if digest.hexdigest() != sha256:
                raise TransferError(f"{what} fails its sha256 check; not served")
            return
        except (TransferError, RegistryError, OSError) as exc:
            failures.append(f"{label}: {exc}")
            job.failures.append(f"{what}: {label}: {exc}")
    raise TransferError(f"{what} (bytes {start}..{end}): " + "; ".join(failures))
