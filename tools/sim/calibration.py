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
    # Network scale-up sources (issues 16, 17): peer / chain multicast / live / ParaServe. Rates in GB/s.
    nic_gbytes_s: float = 12.5  # a host's NIC (100 Gbit/s)
    peer_efficiency: float = 0.954  # one peer transfer's rate ÷ the NIC's
    chain_hop_bytes: float = 3.16e6  # extra time per chain hop, as bytes at the transfer rate
    registry_gbytes_s: float = 50.0  # the registry's total bandwidth (ParaServe's P fetchers share it)
    live_layers: int = 32  # layers of a stage: the granularity a live replica serves and loads in
    paraserve_overlap: bool = True  # a ParaServe worker's fetch runs while its runtime starts (ParaServe §5)
    hbm_gbytes_s: float = 1500.0  # GPU memory bandwidth: a batched decode step reads its sessions' KV at it
    # Service time: stage time = exec_ms / stages × (1 − f + f × cpu_ref / cpus) × Gamma(mean 1, cv)
    service_cv: float = 0.1  # per-request variation of a stage's service time
    cpu_fraction: float = 0.795  # f: share of a stage's time that scales with its CPUs
    cpu_ref: float = 1.0  # CPUs the profiled time was measured with
    # The live emulated setup's costs outside the compute (`quartctl bench hop-costs`; 0 / 1 = none): the sleep's
    # overshoot, the time a stage call holds its replica beyond compute, the router between stages, the front.
    live_compute_factor: float = 1.0
    live_stage_hold_s: float = 0.0
    live_hold_per_call_s: float = 0.0
    live_stage_gap_s: float = 0.0
    live_entry_s: float = 0.0
    live_dispatch_s: float = 0.0
    live_service_cv: float = 0.1
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

    def peer_rate(self, sharers: int = 1) -> float:
        """Bytes/s of one peer transfer when the source's NIC serves ``sharers`` receivers at once."""
        return self.nic_gbytes_s * GB * self.peer_efficiency / max(1, sharers)

    def peer_s(self, stage_bytes: int, sharers: int = 1, position: int = 1) -> float:
        """Peer fetch (or the ``position``-th receiver of a chain): over the network into the host, then a
        fork and the host → GPU copy."""
        rate = self.peer_rate(sharers)
        hops = max(0, position - 1) * self.chain_hop_bytes / rate
        return self.fork_s(stage_bytes) + stage_bytes / rate + hops

    def live_schedule(self, stage_bytes: int, sharers: int = 1, position: int = 1) -> tuple[float, float, int]:
        """(first layer on the GPU, time between layers, layers) of a live start: layers stream from the
        peer (or chain) straight on to the GPU, so copies overlap the transfer."""
        layers = max(1, self.live_layers)
        rate = self.peer_rate(sharers)
        layer_bytes = stage_bytes / layers
        step = max(layer_bytes / rate, layer_bytes / (self.h2d_gbps * GB))
        first = (self.fork_fixed_s + max(0, position - 1) * self.chain_hop_bytes / rate + layer_bytes / rate
                 + layer_bytes / (self.h2d_gbps * GB))
        return first, step, layers

    def paraserve_s(self, stage_bytes: int, parts: int) -> tuple[float, float]:
        """(sub-pipeline serves, worker consolidated) after a ParaServe cold start over ``parts`` hosts: each
        fetches 1/P at its storage rate (``disk_gbps``, capped by its share of the registry), then copies it
        to the GPU; in the background it fetches and copies the rest."""
        parts = max(1, parts)
        rate = min(self.disk_gbps, self.registry_gbytes_s / parts) * GB
        part = stage_bytes / parts
        h2d = self.h2d_gbps * GB
        fetch = part / rate
        first = (max(self.cold_fixed_s, fetch) if self.paraserve_overlap else self.cold_fixed_s + fetch) + part / h2d
        rest = stage_bytes - part
        return first, first + rest / rate + rest / h2d

    def ready_s(self, source: str, stage_bytes: int) -> float:
        if source == "gpu":
            return self.gpu_ready_s
        if source == "fork":
            return self.fork_s(stage_bytes)
        if source == "cold":
            return self.cold_s(stage_bytes)
        if source in ("peer", "multicast"):
            return self.peer_s(stage_bytes)
        raise ValueError(f"unknown replica source {source!r}; one of gpu, fork, peer, multicast, cold")

    def cpu_factor(self, cpus: float) -> float:
        """Service-time multiplier for a replica with ``cpus`` CPUs (1.0 at cpu_ref)."""
        cpus = max(cpus, 1e-3)
        return 1.0 - self.cpu_fraction + self.cpu_fraction * self.cpu_ref / cpus

    def cpu_profile(self, cpu_max: int = 8, service_ms: float = 100.0) -> list[dict]:
        """Profiling records of a simulated replica at 1…``cpu_max`` CPUs: what `quartctl bench cpu-profile`
        records of a live one, so the simulated QUART fits its CPU regression on its own replicas."""
        return [{"cpus": c, "queue_len": 0, "param_bytes": 0, "activation_bytes": 0,
                 "service_ms": service_ms * self.cpu_factor(c)} for c in range(1, max(2, cpu_max) + 1)]

    def cpu_model(self, cpu_max: int = 8):
        """QUART's CPU regression fitted on this calibration's replicas (``cpu_profile``)."""
        from gateway_plugin.policies.cpu_model import CPULatencyModel

        return CPULatencyModel.fit(self.cpu_profile(cpu_max))

    # ------------------------------------------------------------------------------ live data
    def with_cpu_profile(self, path: str | Path) -> Calibration:
        """``cpu_fraction`` from profiling records (`quartctl bench cpu-profile --records`, QUART_CPU_PROFILE):
        the share of a replica's time at 1 CPU that the fitted regression scales with 1/CPUs."""
        from gateway_plugin.policies.cpu_model import CPULatencyModel

        model = CPULatencyModel.default(path)
        src = dict(self.sources)
        src["cpu_fraction"] = f"live: 1 - t(inf)/t(1) of the CPU regression fitted on {path}"
        return replace(self, cpu_fraction=model.cpu_fraction(), cpu_ref=1.0, sources=src)

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
    "nic_gbytes_s": "assumption: 100 Gbit/s per host (BlitzScale Table 1: 100 Gbit/s RDMA per GPU)",
    "peer_efficiency": "live: docs/data/blitz.json, one peer transfer 200 MiB at 1 Gbit/s in 1.759 s (line 1.678 s)",
    "chain_hop_bytes": "live: docs/data/blitz.json, chain of 3 = 1.812 s vs one 1.759 s: 26.5 ms per hop at 0.95 Gbit/s",
    "registry_gbytes_s": "assumption: a registry serving 400 Gbit/s in all (ParaServe: the hosts' NICs are the limit)",
    "paraserve_overlap": "ParaServe §5 (prefetch from the start of the worker); not measured in this project",
    "hbm_gbytes_s": "assumption: ~1.5 TB/s of A100 HBM, the rule of the decoders' profiled decode_ms (presets.py)",
    "live_layers": "assumption: 32 layers per stage (Llama-2-7B's count), the unit a live replica loads and serves",
    "service_cv": "assumption: GPU stage compute varies little per request",
    "cpu_fraction": "QUART Fig. 3b: 4 CPUs cut the median pipeline latency of 2 CPUs by 33 %, "
                    "(1-f+f/4)/(1-f+f/2) = 0.67 → f = 0.795 (or a live `quartctl bench cpu-profile`, with_cpu_profile)",
    "live_compute_factor": "default 1 (no overshoot); `quartctl bench hop-costs --calibration` measures it",
    "live_stage_hold_s": "default 0; `quartctl bench hop-costs --calibration` measures it",
    "live_hold_per_call_s": "default 0; `quartctl bench hop-costs --calibration` measures it",
    "live_stage_gap_s": "default 0; `quartctl bench hop-costs --calibration` measures it",
    "live_entry_s": "default 0; `quartctl bench hop-costs --calibration` measures it",
    "live_dispatch_s": "default 0; `quartctl bench hop-costs --calibration` measures it",
    "live_service_cv": "default QUART_EMULATED_CV; `quartctl bench hop-costs --calibration` measures it",
    "hosts": "QUART §8.1: 12 GPU servers",
    "gpus_per_host": "QUART §8.1: 4 GPUs per server",
    "cpus_per_host": "QUART §8.1: 108 cores per server",
    "host_memory_bytes": "QUART §8.1: 1 TB RAM per server",
    "eviction_threshold": "QUART §6.1: zygotes evicted in LRU order above 85 % memory",
    "PAPER_MODELS": "QUART Table 1: size GB and standalone execution ms; 8 stages each (§8.1)",
}
