"""Live start: a replica that serves a stage's layers while its file is still arriving (BlitzScale §5).

KeysManager side (:func:`start_live`): the localizer starts the stage's transfer with per-layer checks
(``keysmanager.transfer.LayerCheck``) into a pre-sized partial file; at once a *live zygote* is forked from the
preloader (torch and transformers already imported) with ``LIVE_*`` variables naming that file, its progress
file and the manifest. The live zygote waits until the header and the first layer are verified, maps the file
read-only and shared (pages fill in as the writer writes), builds the stage module on the meta device with
tensor views of the mapping attached (no byte is read: bytes not arrived are zeros and never used), and is told
to fork the replica(s) as any zygote is; then it exits (the replicas, re-parented to the KeysManager, keep
serving). The replica reads the progress file per request (``quart_stage.layers.LiveProgress``): it runs only
layers whose bytes are all present and verified, answers 503 for the rest, and is an ordinary full replica once
the whole file is verified (renamed into place: the mapping stays valid). Later starts take the normal path: the
folder is complete, a zygote caches it, replicas fork from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from quart_stage.progress import read_range

from keysmanager.errors import InvalidSpec, StartFailed
from keysmanager.stage import StageRef
from keysmanager.types import StageSpec

if TYPE_CHECKING:
    from keysmanager.localize import LiveTarget
    from keysmanager.records import Replica
    from keysmanager.replicas import Replicas
    from keysmanager.zygotes import Zygotes

LIVE_FILE_ENV, LIVE_PROGRESS_ENV, LIVE_MANIFEST_ENV = "KM_LIVE_FILE", "KM_LIVE_PROGRESS", "KM_LIVE_MANIFEST"
LIVE_WAIT_ENV = "KM_LIVE_WAIT_S"  # how long the live zygote waits for the first verified layer


# ------------------------------------------------------------------------------------ KeysManager side
async def start_live(zygotes: Zygotes, replicas: Replicas, spec: StageSpec, target: LiveTarget,
                     transfer: asyncio.Task, count: int, survive: bool, requested_at: float) -> list[Replica]:
    """Fork ``count`` live replicas of ``spec`` over ``target`` (see the module docstring). StartFailed when the
    transfer ends without a verified first layer or the live zygote fails."""
    if spec.env.get("QUART_COMPUTE") == "cuda":
        raise InvalidSpec("live start serves from host memory as the file fills; a cuda stage copies its "
                          "parameters to the device once, so it cannot start live", "live")
    env = {**spec.env, "QUART_MODEL_DIR": str(target.folder), LIVE_FILE_ENV: str(target.partial),
           LIVE_PROGRESS_ENV: str(target.progress), LIVE_MANIFEST_ENV: str(target.manifest),
           LIVE_WAIT_ENV: str(zygotes.config.zygote_timeout_s)}
    target_at = time.monotonic()
    live_spec = StageSpec(spec.function, env, spec.cpus, spec.memory_bytes, spec.concurrency)
    stage = StageRef(spec.function, env, None, "", 0, "live")
    spawn = asyncio.ensure_future(zygotes.spawn(live_spec, stage, register=False))
    await asyncio.wait([spawn, transfer], return_when=asyncio.FIRST_COMPLETED)
    if not spawn.done() and transfer.done() and not _any_held(target):
        spawn.cancel()  # the transfer ended (failed) before any layer: nothing to serve live
        with contextlib.suppress(BaseException):
            await spawn
        raise StartFailed(f"the live transfer of {spec.function!r} ended before its first layer verified: "
                          f"{_error_of(transfer)}", "live")
    z = await spawn
    target.marks.setdefault("zygote_built", time.time())
    zygote_at = time.monotonic()
    try:
        started = [await replicas.fork(zygotes, z, live_spec, "cow", survive, requested_at) for _ in range(count)]
    finally:
        await zygotes.drop(z, "live start done")
    target.marks.setdefault("forked", time.time())
    layers = _stage_layers(target)
    for rep in started:
        rep.layers, rep.progress = layers, str(target.progress)
        rep.phases.update(target=target_at, **z.phases, zygote=zygote_at, forked=time.monotonic())
    transfer.add_done_callback(lambda _: [rep.phases.setdefault("file", time.monotonic()) for rep in started])
    return started


def _any_held(target: LiveTarget) -> bool:
    lo, hi = read_range(str(target.progress))
    return hi > lo


def _error_of(task: asyncio.Task) -> str:
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return str(exc) if exc is not None else "it ended"


def _stage_layers(target: LiveTarget) -> tuple[int, int] | None:
    from quart_stage.manifest import Manifest

    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, IndexError):
        import json

        entry = Manifest.from_dict(json.loads(target.manifest.read_text())).stage(target.stage_index)
        return entry.start, entry.end
    return None


def held_of(rep: Replica) -> tuple[int, int] | None:
    """The layers a replica holds now: a live one's verified range (its progress file: a prefix, or a ParaServe
    part growing both ways), else its whole stage."""
    if rep.layers is None or rep.progress is None:
        return rep.layers
    start, end = rep.layers
    lo, hi = read_range(rep.progress)
    return (start + lo, min(end, start + hi)) if hi > lo else (start, start)


# ------------------------------------------------------------------------------------ live zygote side
def build_live(env: Mapping[str, str], phases: dict[str, float] | None = None):
    """(mapping, runtime, app, parameter bytes) of a live zygote: the partial file mapped as it fills, once its
    header and first layer are verified. Touches no parameter byte, starts no thread, no GPU. ``phases`` gets
    the monotonic times the first layer was seen (``layer``) and the module built (``built``)."""
    import json

    from quart_stage.app import create_app
    from quart_stage.config import StageConfig
    from quart_stage.layers import LiveProgress
    from quart_stage.manifest import Manifest
    from quart_stage.runtime import StageRuntime
    from quart_stage.segment import ITEMSIZE, read_safetensors_header

    cfg = StageConfig.from_env({k: v for k, v in env.items() if k.startswith("QUART_")})
    manifest = Manifest.from_dict(json.loads(open(env[LIVE_MANIFEST_ENV], encoding="utf-8").read()))
    entry = manifest.stage(cfg.stage_index)
    progress_path, path = env[LIVE_PROGRESS_ENV], env[LIVE_FILE_ENV]
    deadline = time.monotonic() + float(env.get(LIVE_WAIT_ENV, "60"))
    while read_range(progress_path)[1] <= read_range(progress_path)[0]:  # the header and a first layer, verified
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: no verified layer within {env.get(LIVE_WAIT_ENV)} s")
        time.sleep(0.002)
    if phases is not None:
        phases["layer"] = time.monotonic()
    fd = _open_arriving(path)
    try:
        data_start, header = read_safetensors_header(f"/proc/self/fd/{fd}")
        mm = mmap.mmap(fd, entry.file_bytes, access=mmap.ACCESS_READ)  # shared: sees the writer's pages
    finally:
        os.close(fd)
    tensors = _views(mm, data_start, header, ITEMSIZE)
    runtime = StageRuntime.from_tensors(cfg, manifest, tensors)
    runtime.progress = LiveProgress(progress_path, entry.start, entry.end)
    runtime.parameter_source = "live"
    if phases is not None:
        phases["built"] = time.monotonic()
    return mm, runtime, create_app(runtime), entry.file_bytes


def _open_arriving(partial: str) -> int:
    """A descriptor of the stage file still arriving, or of the file it was renamed to meanwhile (the transfer
    finished between the progress check and here: the same inode, complete)."""
    final = partial.removesuffix(".partial")
    for candidate in dict.fromkeys((partial, final)):
        try:
            return os.open(candidate, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"{partial}: neither it nor {final} exists (the transfer failed and was removed)")


def _views(mm: mmap.mmap, data_start: int, header: dict, itemsize: Mapping[str, int]) -> dict:
    """Tensor views of a mapped safetensors file (read-only memory: the stage never writes parameters)."""
    import torch
    from quart_stage.wire import DTYPES

    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        dtype = DTYPES[meta["dtype"]]
        if end == begin:
            tensors[name] = torch.empty(meta["shape"], dtype=dtype)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: never written
            flat = torch.frombuffer(mm, dtype=dtype, count=(end - begin) // itemsize[meta["dtype"]],
                                    offset=data_start + begin)
        tensors[name] = flat.view(meta["shape"])
    return tensors
