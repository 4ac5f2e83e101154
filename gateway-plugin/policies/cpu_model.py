"""QUART's CPU compensator (§5.3, Algorithm 1 `AllocateCPU`): service time ≈ linear regression.

An ordinary least-squares linear regression (numpy ``lstsq``, intercept included) maps (CPUs per replica, queue length, parameter bytes, activation
bytes) to one request's service time at a stage. It is fitted on profiling records the router writes
(one per stage visit: the replica's CPUs, the queue it saw, the stage's parameter and activation
bytes, the measured service time). Work that parallelises over CPUs scales with 1/CPUs, so the
regression's features are 1/c, q, P, A and A/c. ``smallest_cpus`` searches c upward from the current
value in ``cpu_step`` steps and answers the first c whose predicted stage delay meets the target, or
None when even CPU_max does not (the policy then falls back to Correct).

A profile of one model transfers to another as a *ratio*: ``service_ratio(c0, c1)`` is t(c1)/t(c0) at the
profile's own mean features, and the policy multiplies a stage's *measured* service time by it (the stage's
absolute time comes from the live metrics, the CPU scaling from the profile). ``cpu_fraction`` is the share
of the time at 1 CPU that scales with CPUs (the simulator's ``Calibration.cpu_fraction``). The product's
default profile, ``cpu_profile.jsonl`` beside this module, was recorded by ``quartctl bench cpu-profile``
(MiniLM, real weights and real compute at 1 and 2 CPUs; docs/policies.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gateway_plugin.policies.queueing import mmc_delay

RECORD_KEYS = ("cpus", "queue_len", "param_bytes", "activation_bytes", "service_ms")
DEFAULT_PROFILE = Path(__file__).with_name("cpu_profile.jsonl")


def _features(cpus: float, queue_len: float, param_bytes: float, activation_bytes: float) -> list[float]:
    inv = 1.0 / max(cpus, 1e-3)
    act_mb = activation_bytes / 1e6
    return [inv, float(queue_len), param_bytes / 1e9, act_mb, act_mb * inv]


def profiling_rows(lines: Iterable[str]) -> list[dict]:
    """Regression rows from JSONL: flat rows with RECORD_KEYS, or the router's request records, whose
    per-stage visits (cpus, queue_len, param_bytes, activation_bytes, service_ms) become one row each."""
    import json

    rows: list[dict] = []
    for line in lines:
        if not line.strip():
            continue
        doc = json.loads(line)
        if "stages" in doc and isinstance(doc["stages"], list):
            if 200 <= int(doc.get("status", 200)) < 300:
                rows.extend({k: v[k] for k in RECORD_KEYS} for v in doc["stages"])
        else:
            rows.append({k: doc[k] for k in RECORD_KEYS if k in doc})
    return rows


@dataclass(slots=True)
class CPULatencyModel:
    """Fitted regression: predicted service seconds of one request at a stage."""

    coef: tuple[float, ...]  # one per feature of _features
    intercept: float
    records: int
    r2: float
    reference: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the profile's mean queue, parameter and activation bytes

    @classmethod
    def fit(cls, records: Iterable[Mapping[str, float]]) -> CPULatencyModel:
        rows = list(records)
        missing = [k for k in RECORD_KEYS if rows and k not in rows[0]]
        if missing:
            raise ValueError(f"profiling records lack {', '.join(missing)}; each needs {', '.join(RECORD_KEYS)}")
        if len(rows) < 3:
            raise ValueError(f"need at least 3 profiling records to fit the CPU model, got {len(rows)}")
        x = np.array([_features(r["cpus"], r["queue_len"], r["param_bytes"], r["activation_bytes"]) for r in rows])
        y = np.array([r["service_ms"] / 1000.0 for r in rows])
        x_mean, y_mean = x.mean(axis=0), y.mean()
        coef = np.linalg.lstsq(x - x_mean, y - y_mean, rcond=None)[0]  # minimum norm where features are constant
        intercept = float(y_mean - x_mean @ coef)
        residual = float(((y - (x @ coef + intercept)) ** 2).sum())
        total = float(((y - y_mean) ** 2).sum())
        ref = tuple(float(np.mean([r[k] for r in rows])) for k in ("queue_len", "param_bytes", "activation_bytes"))
        return cls(tuple(float(c) for c in coef), intercept, len(rows), 1.0 - residual / total if total > 0 else 0.0, ref)

    @classmethod
    def default(cls, path: str | Path = DEFAULT_PROFILE) -> CPULatencyModel:
        """The model fitted on a profiling JSONL (by default the product's own profile)."""
        with open(path) as fh:
            return cls.fit(profiling_rows(fh))

    def service_ratio(self, cpus_from: float, cpus_to: float) -> float:
        """t(cpus_to) / t(cpus_from) at the profile's mean features (≤ 1 when adding CPUs helps)."""
        q, p, a = self.reference
        return self.service_s(cpus_to, q, p, a) / self.service_s(cpus_from, q, p, a)

    def cpu_fraction(self) -> float:
        """Share of the time at 1 CPU that scales as 1/CPUs: 1 − t(∞)/t(1), within [0, 1]."""
        return min(1.0, max(0.0, 1.0 - self.service_ratio(1.0, 1e9)))

    def service_s(self, cpus: float, queue_len: float, param_bytes: float, activation_bytes: float) -> float:
        x = _features(cpus, queue_len, param_bytes, activation_bytes)
        return max(1e-6, self.intercept + sum(c * v for c, v in zip(self.coef, x, strict=True)))

    def smallest_cpus(
        self,
        *,
        arrival_rate: float,
        servers: int,
        queue_len: float,
        param_bytes: float,
        activation_bytes: float,
        target_s: float,
        cpus_from: float,
        cpu_max: float,
        cpu_step: float,
    ) -> float | None:
        """Smallest c in [cpus_from, cpu_max] whose predicted M/M/c delay ≤ target_s; None if none."""
        steps = int(math.floor((cpu_max - cpus_from) / cpu_step + 1e-9))
        for k in range(steps + 1):
            c = cpus_from + k * cpu_step
            service = self.service_s(c, queue_len, param_bytes, activation_bytes)
            mu = 1.0 / service
            delay = mmc_delay(arrival_rate, mu, servers)
            if servers > 0:
                delay = max(delay, queue_len / (servers * mu) + service)
            if delay <= target_s:
                return round(c, 6)
        return None


@functools.cache
def default_cpu_model() -> CPULatencyModel:
    """The model fitted on the product's own profile (``DEFAULT_PROFILE``), fitted once per process."""
    return CPULatencyModel.default()
