"""Stage configuration, read from the environment (the OpenFaaS / of-watchdog convention).

Every setting has a documented default; docs/stage-runtime.md lists them. Nothing here touches torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from quart_stage.settings import ConfigError, settings_from_env

COMPUTE_MODES = ("cpu", "cuda", "emulated")


def computes_on_cpu(env: Mapping[str, str]) -> bool:
    """Whether a function with these environment variables is a model stage computing on the CPU (it names a model
    and ``QUART_COMPUTE`` is ``cpu``, the default): its replicas share their machine's cores."""
    named = bool(env.get("QUART_MODEL_DIR") or env.get("QUART_MODEL_URL"))
    return named and (env.get("QUART_COMPUTE") or "cpu").strip().lower() == "cpu"
DEVICE_COPY_METHODS = ("auto", "staged", "register", "pageable")  # how quart_stage.device_copy moves parameters

DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
"""Largest request body a stage reads (QUART_MAX_BODY_BYTES); larger bodies get 413 before being read."""


@dataclass(frozen=True)
class StageConfig:
    """What one stage replica needs to know (env var in brackets).

    model_dir       [QUART_MODEL_DIR]        partitioned model folder (manifest.json, stage-<i>.safetensors);
                                             None only for parameter-free emulated stages. Relative paths are
                                             resolved against the current working directory.
    stage_index     [QUART_STAGE_INDEX]      0-based stage index (default 0)
    num_stages      [QUART_NUM_STAGES]       stage count (default: the manifest's; 1 without a manifest)
    compute         [QUART_COMPUTE]          cpu | cuda | emulated (default cpu)
    max_body_bytes  [QUART_MAX_BODY_BYTES]   request body limit (default 256 MiB)
    model           [QUART_MODEL]            model name for parameter-free emulated stages (default: profile)
    profile         [QUART_PROFILE]          paper profile for emulated service times, e.g. bert-21b
    emulated_mean_ms [QUART_EMULATED_MEAN_MS] mean emulated service time of this stage (overrides the profile)
    emulated_cv     [QUART_EMULATED_CV]      coefficient of variation of emulated service time (default 0.1)
    emulated_cpu_fraction [QUART_EMULATED_CPU_FRACTION] share f of the emulated time that parallelises over the
                                             replica's cores c (its CPU affinity): time × (1 − f + f/c) (default 0)
    emulated_activation_bytes [QUART_EMULATED_ACTIVATION_BYTES] per-request output size override (emulated)
    emulated_decode_ms [QUART_EMULATED_DECODE_MS] emulated time of one generation decode step of this stage
                                             (default: the profile's decode time x the stage's share, else the mean)
    emulated_prefill_ms_per_token [QUART_EMULATED_PREFILL_MS_PER_TOKEN] emulated prefill time per position of
                                             this stage (default: the profile's exec_ms / its sequence x share)
    kv_max_tokens   [QUART_KV_MAX_TOKENS]    KV-cache positions this replica holds over all generation sessions
                                             (default 0 = auto: what 1 GiB of the stage's K/V holds, 1024..65536)
    kv_idle_s       [QUART_KV_IDLE_S]        a generation session idle this long is freed (default 120)
    seed            [QUART_SEED]             seed of the emulated service-time draw (default: from pid)
    threads         [QUART_THREADS]          torch intra-op threads per replica (default 1)
    max_batch       [QUART_MAX_BATCH]        largest batch accepted (default 64)
    max_inflight    [QUART_MAX_INFLIGHT]     concurrent requests per replica before 429 (0 = unlimited, default)
    max_text_chars  [QUART_MAX_TEXT_CHARS]   longest ``text`` (characters, all texts of a batch together) read
                                             before tokenizing; longer: 413 (0 = 16 × the model's positions, or
                                             65,536 without them; default 0)
    memory_headroom_bytes [QUART_MEMORY_HEADROOM_BYTES] a replica's private memory beyond what it holds when it
                                             starts serving (RLIMIT_DATA, quart_stage.memlimit; 0 = max(1 GiB,
                                             2 × its parameter bytes); negative = unbounded; default 0)
    verify_checksum [QUART_VERIFY_CHECKSUM]  1: check the stage file's sha256 against the manifest on load (default 0;
                                             the file size is always checked)
    device          [QUART_DEVICE]           torch device for cuda mode (default cuda:0 or the first visible GPU)
    device_copy     [QUART_DEVICE_COPY]      how parameters reach the GPU after a fork: auto (default: staged
                                             from 1 GB, else pageable) | staged (pinned double buffer) |
                                             register (page-lock in place) | pageable
    model_url       [QUART_MODEL_URL]        the model in the registry (s3://bucket/prefix); a stage reaches it only
                                             through its node's KeysManager (quart_stage.attach)
    keysmanager_socket [QUART_KEYSMANAGER_SOCKET] the node's KeysManager socket: start from its parameter cache
                                             (quart_stage.attach), falling back to QUART_MODEL_DIR
    keysmanager_timeout_s [QUART_KEYSMANAGER_TIMEOUT_S] how long to wait for the KeysManager to cache the stage
                                             (default 300)
    """

    model_dir: str | None = None
    stage_index: int = 0
    num_stages: int | None = None
    compute: str = "cpu"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model: str | None = None
    profile: str | None = None
    emulated_mean_ms: float | None = None
    emulated_cv: float = 0.1
    emulated_cpu_fraction: float = 0.0
    emulated_activation_bytes: int | None = None
    emulated_decode_ms: float | None = None
    emulated_prefill_ms_per_token: float | None = None
    kv_max_tokens: int = 0
    kv_idle_s: float = 120.0
    seed: int | None = None
    threads: int = 1
    max_batch: int = 64
    max_inflight: int = 0
    max_text_chars: int = 0
    memory_headroom_bytes: int = 0
    verify_checksum: bool = False
    device: str | None = None
    device_copy: str = "auto"
    model_url: str | None = None
    keysmanager_socket: str | None = None
    keysmanager_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        # normalised forms: an absolute model folder, a lower-case mode, 0 meaning "not set"
        if self.model_dir:
            object.__setattr__(self, "model_dir", os.path.abspath(self.model_dir))
        object.__setattr__(self, "compute", self.compute.strip().lower())
        object.__setattr__(self, "num_stages", self.num_stages or None)
        object.__setattr__(self, "emulated_activation_bytes", self.emulated_activation_bytes or None)
        if self.compute not in COMPUTE_MODES:
            raise ConfigError(f"QUART_COMPUTE must be one of {', '.join(COMPUTE_MODES)}, got {self.compute!r}")
        if self.stage_index < 0:
            raise ConfigError(f"QUART_STAGE_INDEX must be >= 0, got {self.stage_index}")
        if self.num_stages is not None and not 0 <= self.stage_index < self.num_stages:
            raise ConfigError(
                f"QUART_STAGE_INDEX={self.stage_index} is outside 0..{self.num_stages - 1} (QUART_NUM_STAGES)"
            )
        if self.max_body_bytes <= 0:
            raise ConfigError("QUART_MAX_BODY_BYTES must be positive")
        if self.emulated_cv < 0:
            raise ConfigError("QUART_EMULATED_CV must be >= 0")
        if not 0.0 <= self.emulated_cpu_fraction <= 1.0:
            raise ConfigError(f"QUART_EMULATED_CPU_FRACTION must be within [0, 1], got {self.emulated_cpu_fraction}")
        if self.device_copy not in DEVICE_COPY_METHODS:
            raise ConfigError(f"QUART_DEVICE_COPY must be one of {', '.join(DEVICE_COPY_METHODS)}, "
                              f"got {self.device_copy!r}")
        if self.kv_max_tokens < 0:
            raise ConfigError("QUART_KV_MAX_TOKENS must be >= 0 (0 = auto)")
        if self.kv_idle_s <= 0:
            raise ConfigError("QUART_KV_IDLE_S must be positive")
        for name, value in (("QUART_EMULATED_DECODE_MS", self.emulated_decode_ms),
                            ("QUART_EMULATED_PREFILL_MS_PER_TOKEN", self.emulated_prefill_ms_per_token)):
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.keysmanager_timeout_s <= 0:
            raise ConfigError("QUART_KEYSMANAGER_TIMEOUT_S must be positive")
        if self.model_dir is None and self.model_url is None and self.compute != "emulated":
            raise ConfigError(f"QUART_MODEL_DIR (or QUART_MODEL_URL) is required for compute mode {self.compute!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StageConfig:
        """Read the QUART_<FIELD> variables (os.environ by default) with quart_stage.settings' rules."""
        return settings_from_env(cls, "QUART_", env)

    def to_env(self) -> dict[str, str]:
        """The QUART_* variables that reproduce this config (for stack.yml and child processes)."""
        env = {
            "QUART_STAGE_INDEX": str(self.stage_index),
            "QUART_COMPUTE": self.compute,
            "QUART_MAX_BODY_BYTES": str(self.max_body_bytes),
            "QUART_THREADS": str(self.threads),
        }
        if self.model_dir:
            env["QUART_MODEL_DIR"] = self.model_dir
        if self.num_stages is not None:
            env["QUART_NUM_STAGES"] = str(self.num_stages)
        optional = {
            "QUART_MODEL": self.model,
            "QUART_PROFILE": self.profile,
            "QUART_EMULATED_MEAN_MS": self.emulated_mean_ms,
            "QUART_EMULATED_CPU_FRACTION": self.emulated_cpu_fraction or None,
            "QUART_EMULATED_ACTIVATION_BYTES": self.emulated_activation_bytes,
            "QUART_EMULATED_DECODE_MS": self.emulated_decode_ms,
            "QUART_EMULATED_PREFILL_MS_PER_TOKEN": self.emulated_prefill_ms_per_token,
            "QUART_KV_MAX_TOKENS": self.kv_max_tokens or None,
            "QUART_KV_IDLE_S": self.kv_idle_s if self.kv_idle_s != 120.0 else None,
            "QUART_SEED": self.seed,
            "QUART_DEVICE": self.device,
            "QUART_DEVICE_COPY": self.device_copy if self.device_copy != "auto" else None,
            "QUART_MODEL_URL": self.model_url,
            "QUART_KEYSMANAGER_SOCKET": self.keysmanager_socket,
        }
        env.update({k: str(v) for k, v in optional.items() if v is not None})
        if self.compute == "emulated":
            env["QUART_EMULATED_CV"] = str(self.emulated_cv)
        return env
