"""Start a stage from its node's parameter cache: the path a stage pod takes on Kubernetes.

With ``QUART_KEYSMANAGER_SOCKET`` set (the admission policy of deploy/kubernetes mounts the node's
KeysManager socket and segment folder into stage pods), :func:`load_stage` asks that KeysManager
(``POST /v1/attach``, JSON over its Unix socket) to cache the stage — a zygote loads it once per node — and
answer its parameter segment's path and tensor index. The stage maps the segment copy-on-write from a
read-only descriptor (``quart_stage.segment``: shared pages, never written, nothing copied) and builds its
runtime with ``StageRuntime.from_tensors``. On any failure (no socket, a KeysManager error, a segment that
does not match its index or the stage's manifest) it logs why and loads as a stage without a KeysManager
does: from ``QUART_MODEL_DIR``. A stage never reads the model registry itself (``QUART_MODEL_URL``): only
through the KeysManager.

The stage names itself to the KeysManager by its model folder or URL, index and a hash of its ``QUART_*``
settings: every replica of one function sends the same name and environment, so they share one zygote.
"""

from __future__ import annotations

import logging
import time

from quart_stage.config import StageConfig
from quart_stage.manifest import Manifest
from quart_stage.nodecache import NodeCacheError, km_call, stage_spec
from quart_stage.runtime import StageRuntime
from quart_stage.segment import SegmentIndex, map_segment

ATTACH_ROUTE = "/v1/attach"

log = logging.getLogger("quart_stage.attach")


class AttachError(RuntimeError):
    """The node's cache could not give this stage its parameters (the message says why)."""


def ask_keysmanager(socket_path: str, spec: dict, timeout_s: float) -> dict:
    """``POST /v1/attach`` on the KeysManager's socket; its answer, or AttachError naming the cause."""
    try:
        return km_call(socket_path, "POST", ATTACH_ROUTE, {"spec": spec}, timeout_s)
    except NodeCacheError as exc:
        raise AttachError(str(exc)) from None


def attach(cfg: StageConfig) -> StageRuntime:
    """The stage's runtime over its node's cached segment (raises AttachError and the segment's errors)."""
    answer = ask_keysmanager(cfg.keysmanager_socket, stage_spec(cfg), cfg.keysmanager_timeout_s)
    index = SegmentIndex.from_dict(answer.get("segment"))
    manifest = Manifest.load(cfg.model_dir) if cfg.model_dir else Manifest.from_dict(answer["manifest"])
    entry = manifest.stage(cfg.stage_index)
    if entry.sha256 and answer.get("sha256") != entry.sha256:
        raise AttachError(f"the node caches another checkpoint of this stage (sha256 {answer.get('sha256')}, "
                          f"the manifest says {entry.sha256})")
    _, tensors = map_segment(index)  # the tensors keep the mapping alive
    runtime = StageRuntime.from_tensors(cfg, manifest, tensors)
    runtime.parameter_source = "node-cache"
    return runtime


def load_stage(cfg: StageConfig) -> StageRuntime:
    """The stage's runtime: from the node's cache when ``cfg.keysmanager_socket`` is set and that works,
    else ``StageRuntime.load`` (the model folder)."""
    if cfg.keysmanager_socket:
        started = time.perf_counter()
        try:
            runtime = attach(cfg)
        except Exception as exc:  # any failure of the cache path falls back to the folder; say why
            log.warning("stage %d: not started from the node cache (%s: %s); loading from %s", cfg.stage_index,
                        type(exc).__name__, exc, cfg.model_dir or "QUART_MODEL_DIR (unset)")
        else:
            log.info("stage %d: %d parameter bytes mapped from the node cache in %.1f ms", cfg.stage_index,
                     runtime.parameter_bytes, (time.perf_counter() - started) * 1e3)
            return runtime
    return StageRuntime.load(cfg)
