"""QUART's CPU compensator (§5.3, Algorithm 1 `AllocateCPU`): service time ≈ linear regression.

A scikit-learn ``LinearRegression`` maps (CPUs per replica, queue length, parameter bytes, activation
bytes) to one request's service time at a stage. It is fitted on profiling records the router writes
(one per stage visit: the replica's CPUs, the queue it saw, the stage's parameter and activation
bytes, the measured service time). Work that parallelises over CPUs scales with 1/CPUs, so the
regression's features are 1/c, q, P, A and A/c. ``smallest_cpus`` searches c upward from the current
value in ``cpu_step`` steps and answers the first c whose predicted stage delay meets the target, or
None when even CPU_max does not (the policy then falls back to Correct).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from gateway_plugin.policies.queueing import mmc_delay

if TYPE_CHECKING:  # scikit-learn takes ~1 s to import (3 s on a loaded box): only `fit` needs it, so the
    from sklearn.linear_model import LinearRegression  # gateway's start does not wait for it (issue 14)

RECORD_KEYS = ("cpus", "queue_len", "param_bytes", "activation_bytes", "service_ms")


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

    regression: LinearRegression
    records: int
    r2: float

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
        from sklearn.linear_model import LinearRegression

        reg = LinearRegression().fit(x, y)
        return cls(reg, len(rows), float(reg.score(x, y)) if len(rows) > 1 else 0.0)

    def service_s(self, cpus: float, queue_len: float, param_bytes: float, activation_bytes: float) -> float:
        x = np.array([_features(cpus, queue_len, param_bytes, activation_bytes)])
        return max(1e-6, float(self.regression.predict(x)[0]))

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
