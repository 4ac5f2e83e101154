"""Numbers the simulator is calibrated with, each with its source.

Two kinds of source: the QUART paper (Table 1 model sizes and standalone execution times; ≈800 ms to
copy a 1/8 BERT-21B stage host → GPU; ≈45 s to load it from disk) and live measurements of this
project (`quartctl bench keysmanager` JSON: fork and cold replica-ready times by stage size; stage
service times from loadgen records). ``Calibration.to_json()`` writes the values with a ``sources``
map saying where each came from; ``Calibration.load(path)`` reads such a file back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
from quart_stage.presets import PAPER_PROFILES, PaperProfile

GB = 1_000_000_000


# QUART paper, Table 1 (size GB, operators, tokens, standalone exec ms), kept by the stage runtime.
PAPER_MODELS: dict[str, PaperProfile] = PAPER_PROFILES
PAPER_STAGES = 8  # §8.1: every model split into 8 stages with DeepSpeed


def activation_bytes(profile: PaperProfile) -> float:
    """Bytes of one request's activations between stages (batch 1 × seq × hidden, in its dtype)."""
    itemsize = 2 if profile.dtype in ("float16", "bfloat16") else 4
    return float(profile.seq * profile.hidden * itemsize)


_BERT_STAGE_GB = PAPER_MODELS["bert-21b"].size_gb / PAPER_STAGES  # 5.375 GB


@dataclass(frozen=True)
class Calibration:
    """Scale-up delays, service-time model and cluster defaults of the simulator."""

    # Scale-up delay by source: fixed part (process / runtime start) + bytes ÷ bandwidth.
    gpu_ready_s: float = 0.05  # replica resident on a GPU already: only registration with the router
    fork_fixed_s: float = 0.10  # KeysManager fork until the replica answers (no GPU copy)
    h2d_gbps: float = _BERT_STAGE_GB / 0.8  # host → GPU copy rate, GB/s (≈6.7)
    cold_fixed_s: float = 2.0  # interpreter, imports, runtime set-up of a cold replica
    disk_gbps: float = _BERT_STAGE_GB / (45.0 - 2.0)  # disk → host rate, GB/s (≈0.125)
    # Service time: stage time = exec_ms / stages × (1 − f + f × cpu_ref / cpus) × Gamma(mean 1, cv)
    service_cv: float = 0.1  # per-request variation of a stage's service time
    cpu_fraction: float = 0.2  # f: share of a stage's time that scales with its CPUs
    cpu_ref: float = 1.0  # CPUs the profiled time was measured with
    # Cluster (paper §8.1: 12 GPU servers, 4 GPUs, 108 cores, 1 TB RAM each).
    hosts: int = 12
    gpus_per_host: int = 4
    cpus_per_host: int = 108
    host_memory_bytes: int = 1024 * GB
    eviction_threshold: float = 0.85  # KeysManager evicts zygotes above this memory fraction
    sources: dict[str, str] = field(default_factory=lambda: dict(_PAPER_SOURCES))

    # ---------------------------------------------------------------- delays and service times
    def fork_s(self, stage_bytes: int) -> float:
        """Replica start by KeysManager fork plus host → GPU parameter copy."""
        return self.fork_fixed_s + stage_bytes / (self.h2d_gbps * GB)

    def cold_s(self, stage_bytes: int) -> float:
        """Cold start: process start plus reading the parameters from disk plus host → GPU copy."""
        return self.cold_fixed_s + stage_bytes / (self.disk_gbps * GB) + stage_bytes / (self.h2d_gbps * GB)

    def ready_s(self, source: str, stage_bytes: int) -> float:
        if source == "gpu":
            return self.gpu_ready_s
        if source == "fork":
            return self.fork_s(stage_bytes)
        if source == "cold":
            return self.cold_s(stage_bytes)
        raise ValueError(f"unknown replica source {source!r}; one of gpu, fork, cold")

    def cpu_factor(self, cpus: float) -> float:
        """Service-time multiplier for a replica with ``cpus`` CPUs (1.0 at cpu_ref)."""
        cpus = max(cpus, 1e-3)
        return 1.0 - self.cpu_fraction + self.cpu_fraction * self.cpu_ref / cpus

    # ------------------------------------------------------------------------------ live data
    def with_keysmanager_bench(self, path: str | Path) -> Calibration:
        """Fixed fork/cold start costs from `quartctl bench keysmanager` JSON (rows of stage_mb,
        fork_ready_ms, cold_ready_ms): the intercept of a straight-line fit over stage size.

        This machine has no GPU and reads checkpoints from the page cache, so only the fixed
        parts come from it; the per-byte rates (host → GPU, disk) stay the paper's.
        """
        doc = json.loads(Path(path).read_text())
        rows = doc.get("rows") or []
        if len(rows) < 1:
            raise ValueError(f"{path}: no rows of stage_mb, fork_ready_ms, cold_ready_ms")
        mb = np.array([float(r["stage_mb"]) for r in rows])
        fork = np.array([float(r["fork_ready_ms"]) for r in rows]) / 1000.0
        cold = np.array([float(r["cold_ready_ms"]) for r in rows]) / 1000.0

        def intercept(y: np.ndarray) -> float:
            if len(y) >= 2 and np.ptp(mb) > 0:
                return float(max(np.polyfit(mb, y, 1)[1], y.min() * 0.5))
            return float(y.min())

        src = dict(self.sources)
        src["fork_fixed_s"] = f"live: intercept of fork_ready_ms over stage_mb in {path}"
        src["cold_fixed_s"] = f"live: intercept of cold_ready_ms over stage_mb in {path}"
        return replace(self, fork_fixed_s=intercept(fork), cold_fixed_s=intercept(cold), sources=src)

    # -------------------------------------------------------------------------------- files
    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        doc = json.loads(Path(path).read_text())
        names = {f.name for f in fields(cls)}
        unknown = set(doc) - names
        if unknown:
            raise ValueError(f"{path}: unknown calibration keys {sorted(unknown)}; known: {sorted(names)}")
        return cls(**doc)


_PAPER_SOURCES = {
    "gpu_ready_s": "assumption: a resident replica only needs the router to learn of it",
    "fork_fixed_s": "default (overridden by live `quartctl bench keysmanager` fork times when given)",
    "h2d_gbps": "QUART §6.1: ≈800 ms to load 1/8 of BERT-21B (5.4 GB) host → GPU",
    "cold_fixed_s": "default (overridden by live `quartctl bench keysmanager` cold times when given)",
    "disk_gbps": "QUART §6.1: ≈45 s to load 1/8 of BERT-21B from disk (43 s of reading + the default 2 s fixed)",
    "service_cv": "assumption: GPU stage compute varies little per request",
    "cpu_fraction": "assumption: share of stage time in CPU work (serde, copies); QUART §5.3",
    "hosts": "QUART §8.1: 12 GPU servers",
    "gpus_per_host": "QUART §8.1: 4 GPUs per server",
    "cpus_per_host": "QUART §8.1: 108 cores per server",
    "host_memory_bytes": "QUART §8.1: 1 TB RAM per server",
    "eviction_threshold": "QUART §6.1: zygotes evicted in LRU order above 85 % memory",
    "PAPER_MODELS": "QUART Table 1: size GB and standalone execution ms; 8 stages each (§8.1)",
}
