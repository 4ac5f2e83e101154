"""The KeysManager's view of a stage: where its checkpoint is, its fingerprint, and how to build its runtime.

``resolve_stage`` runs in the daemon and reads only ``manifest.json`` (no torch). ``build_runtime`` runs in a
zygote or a cold replica and uses the stage runtime (``quart_stage``) as the contract says:
``StageRuntime.from_tensors`` over the shared-memory tensors, or ``StageRuntime.load`` from disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from quart_stage.config import ConfigError, StageConfig
from quart_stage.manifest import Manifest, stage_path


class UnknownStage(LookupError):
    """The environment names no stage that exists (no manifest, or an index outside the model)."""

    def __init__(self, message: str, field: str = "spec.env.QUART_MODEL_DIR") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class StageRef:
    """A resolved stage: what the daemon needs to cache it and to notice that its checkpoint changed."""

    function: str
    env: dict[str, str]
    checkpoint: Path | None  # None: a parameter-free (emulated) stage
    sha256: str
    param_bytes: int
    fingerprint: str  # changes when the checkpoint (manifest sha256, file size/mtime) or the environment does
    layers: tuple[int, int] | None = None  # the stage's layer range [S, E) (None without a manifest)


def _config(env: Mapping[str, str]) -> StageConfig:
    try:
        return StageConfig.from_env(dict(env))
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def resolve_stage(function: str, env: Mapping[str, str]) -> StageRef:
    """Find the stage's checkpoint from its environment. Raises UnknownStage or ValueError."""
    cfg = _config(env)
    checkpoint: Path | None = None
    sha, nbytes, stat_key, layers = "", 0, (), None
    if cfg.model_dir is not None:
        if not os.path.isdir(cfg.model_dir):
            raise UnknownStage(f"model folder {cfg.model_dir} does not exist")
        try:
            manifest = Manifest.load(cfg.model_dir)
        except (FileNotFoundError, ValueError, TypeError, KeyError) as exc:
            raise UnknownStage(str(exc)) from None
        if not 0 <= cfg.stage_index < manifest.num_stages:
            raise UnknownStage(f"model {manifest.model!r} has stages 0..{manifest.num_stages - 1}, "
                               f"not {cfg.stage_index}", "spec.env.QUART_STAGE_INDEX")
        entry = manifest.stage(cfg.stage_index)
        sha, layers = entry.sha256 or "", (entry.start, entry.end)
        if entry.file is not None:
            try:
                checkpoint = Path(stage_path(cfg.model_dir, entry.file))  # never outside the model folder
            except ValueError as exc:
                raise UnknownStage(str(exc)) from None
            try:
                st = checkpoint.stat()
            except OSError:
                raise UnknownStage(f"stage file {checkpoint} is missing") from None
            nbytes, stat_key = st.st_size, (st.st_size, st.st_mtime_ns, st.st_ino)
    key = json.dumps({"env": dict(sorted(env.items())), "sha256": sha, "stat": stat_key}).encode()
    return StageRef(function, dict(env), checkpoint, sha, nbytes, hashlib.sha256(key).hexdigest()[:16], layers)


def stage_checkpoint(env: Mapping[str, str]) -> Path | None:
    """The stage file a zygote copies into shared memory (None for a parameter-free stage)."""
    return resolve_stage("zygote", env).checkpoint


def build_runtime(env: Mapping[str, str], tensors: dict | None):
    """(runtime, WSGI app): from shared tensors when given, else loaded from disk. Touches no GPU."""
    from quart_stage.app import create_app
    from quart_stage.runtime import StageRuntime

    cfg = _config(env)
    if tensors is None:
        runtime = StageRuntime.load(cfg)
    else:
        manifest = Manifest.load(cfg.model_dir) if cfg.model_dir else None
        runtime = StageRuntime.from_tensors(cfg, manifest, tensors)
    app = create_app(runtime)
    return runtime, app


def warm_up(app) -> None:
    """Run one health request through the WSGI app in the zygote, so lazy imports and URL-map compilation
    happen once there instead of in every forked replica. Starts no thread, computes nothing."""
    with app.test_client() as client:
        client.get("/_/health")
