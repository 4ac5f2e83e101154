"""QUART's pipeline-stage smoother (§5.2, Eq. 7): Laplace smoothing of replica demand by CV.

y'_i = β(CV_i)·ŷ_i + (1 − β(CV_i))·mean_{j∈N(i)} ŷ_j, with N(i) the predecessor and successor.
β(CV) = CV^p / (CV^p + h^p) is monotone from 0 (smooth, Poisson-or-calmer traffic: follow the
neighbours) to 1 (bursty: keep the stage's own demand). The smoother only ever *reclaims*: the result
is min(ŷ_i, ⌈y'_i⌉), never below r_min nor below the replicas busy right now.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway_plugin.config import SmoothConfig


def beta(cv: float, cfg: SmoothConfig) -> float:
    """β(CV) ∈ [0, 1], non-decreasing in CV."""
    if not math.isfinite(cv):
        return 1.0
    cv = max(0.0, cv)
    num = cv**cfg.beta_power
    return num / (num + cfg.beta_cv_half**cfg.beta_power) if num > 0 else 0.0


def smoothed_demand(demand: Sequence[int], index: int, beta_i: float) -> float:
    """Eq. 7 for stage ``index`` of a chain of stages."""
    neighbours = [demand[j] for j in (index - 1, index + 1) if 0 <= j < len(demand)]
    if not neighbours:
        return float(demand[index])
    return beta_i * demand[index] + (1.0 - beta_i) * sum(neighbours) / len(neighbours)


def reclaim_target(demand: Sequence[int], index: int, beta_i: float, r_min: int, busy_replicas: int) -> int:
    """Replicas stage ``index`` keeps after smoothing: ≤ ŷ_i, ≥ r_min, ≥ busy replicas."""
    y = smoothed_demand(demand, index, beta_i)
    return min(demand[index], max(r_min, busy_replicas, math.ceil(y - 1e-9)))
