"""KL-divergence dispersion of key-stage replicas over hosts (QUART §6.2, Eq. 8–10). Pure numpy.

P is the N × M matrix of the paper: row i is the placement distribution of new key-stage replica i
over the M hosts. Taken literally, Σ_i KL(P_i ‖ Q_i) with a uniform Q is minimised by P = Q whatever
the cluster looks like, so we apply Eq. 8 to what the paper says it measures, the *spread of each
key stage* over the hosts: for stage s with E_sj live replicas on host j and new replicas i ∈ s,

    p_sj = (E_sj + Σ_{i∈s} P_ij) / (E_s + n_s),      D = Σ_s KL(p_s ‖ Q),  Q_j = 1/M,

whose gradient is Eq. 9 through the chain rule, ∂D/∂P_ij = (1 + log(p_sj / Q_j)) / (E_s + n_s).
A linear cold-start term γ·Σ_ij P_ij·c_sj (c = 0 where the stage is cached) keeps the cache-first
rule inside the objective. Each step is Eq. 10, P ← P − α∇, followed by a projection of every row
onto the probability simplex over the hosts that can take it, alternated with a scaling of the
columns down to the hosts' free GPU slots; α is halved whenever a step would not lower the
objective, so the objective decreases monotonically until it converges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from quart_kernel.scheduling.config import SchedulerConfig

_EPS = 1e-12
_INFEASIBLE = -1e9  # stands in for −∞ in the simplex projection
# a column counts as over its capacity beyond this much (the rounding enforces capacity exactly anyway);
# 1e-9 made the alternating projections run ~17 rounds for overshoots that change no placement
_CAPACITY_SLACK = 1e-6


@dataclass(frozen=True)
class DispersionProblem:
    """Key stages s = 0..S-1 and hosts j = 0..M-1 of one batch."""

    requested: np.ndarray  # (S,) new replicas of each key stage
    existing: np.ndarray  # (S, M) live replicas of each key stage per host
    feasible: np.ndarray  # (S, M) bool: host j may take a replica of stage s
    capacity: np.ndarray  # (M,) free GPU slots
    cold_cost: np.ndarray  # (S, M) per-replica start cost: 0 cached, 1 cold, 2 cold with eviction
    initial: np.ndarray  # (S, M) where a greedy rule would put stage s's new replicas (counts)

    @property
    def groups(self) -> np.ndarray:
        """(N,) stage index of every new replica (row of P)."""
        return np.repeat(np.arange(len(self.requested)), self.requested.astype(int))


@dataclass(frozen=True)
class DispersionResult:
    P: np.ndarray  # (N, M) final placement probabilities
    expected: np.ndarray  # (S, M) expected new replicas per stage and host (row sums of P per stage)
    kl_history: tuple[float, ...]  # Σ_s KL(p_s ‖ Q) before the first and after every accepted step
    objective_history: tuple[float, ...]  # KL + γ·cold-start term, same points; never increases
    iterations: int
    converged: bool


def spread_kl(counts: np.ndarray) -> float:
    """Σ_s KL(p_s ‖ uniform) of per-stage replica counts (S, M); stages without replicas add 0."""
    counts = np.asarray(counts, dtype=float)
    if counts.ndim == 1:
        counts = counts[None, :]
    totals = counts.sum(axis=1, keepdims=True)
    m = counts.shape[1]
    p = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p * m), 0.0)
    return float(terms.sum())


def project_rows_to_simplex(v: np.ndarray, feasible: np.ndarray) -> np.ndarray:
    """Euclidean projection of each row of `v` onto {x ≥ 0, Σx = 1, x_j = 0 where not feasible}.

    Sort-based algorithm (Held et al. 1974; Duchi et al. 2008), vectorised over rows. Rows without
    any feasible entry come back all zero.
    """
    return _Projector(feasible, np.full(v.shape[1], np.inf), 0).rows(v)


class _Projector:
    """Rows on the simplex, columns (approximately) within capacity: alternating projections. Holds the
    per-problem constants (masks, ranks), since the descent projects thousands of times."""

    def __init__(self, feasible_rows: np.ndarray, capacity: np.ndarray, rounds: int) -> None:
        self.feasible = feasible_rows
        self.keep = feasible_rows & feasible_rows.any(axis=1, keepdims=True)
        self.k = np.arange(1, feasible_rows.shape[1] + 1)
        self.last = feasible_rows.shape[1] - 1
        self.index = np.arange(feasible_rows.shape[0])
        self.limit = capacity + _CAPACITY_SLACK
        self.capacity = capacity
        self.rounds = rounds

    def rows(self, v: np.ndarray) -> np.ndarray:
        v = np.where(self.feasible, v, _INFEASIBLE)
        u = np.sort(v, axis=1)[:, ::-1]
        css = np.cumsum(u, axis=1) - 1.0
        cond = u - css / self.k > 0
        rho = np.where(cond.any(axis=1), self.last - np.argmax(cond[:, ::-1], axis=1), 0)
        theta = css[self.index, rho] / (rho + 1)
        return np.where(self.keep, np.maximum(v - theta[:, None], 0.0), 0.0)

    def __call__(self, P: np.ndarray) -> np.ndarray:
        P = self.rows(P)
        for _ in range(self.rounds):
            col = P.sum(axis=0)
            over = col > self.limit
            if not over.any():
                break
            P[:, over] *= self.capacity[over] / col[over]
            P = self.rows(P)
        return P


class _Objective:
    def __init__(self, problem: DispersionProblem, cache_weight: float) -> None:
        self.problem = problem
        self.groups = problem.groups
        self.onehot = np.eye(len(problem.requested))[self.groups] if len(self.groups) else np.zeros((0, 0))
        self.totals = problem.existing.sum(axis=1) + problem.requested  # (S,)
        self.m = problem.existing.shape[1]
        self.cost_rows = problem.cold_cost[self.groups]  # (N, M)
        self.cache_weight = cache_weight

    def spread(self, P: np.ndarray) -> np.ndarray:
        return self.problem.existing + self.onehot.T @ P  # (S, M)

    def kl(self, P: np.ndarray) -> float:
        return spread_kl(self.spread(P))

    def value(self, P: np.ndarray) -> float:
        return self.kl(P) + self.cache_weight * float((P * self.cost_rows).sum())

    def gradient(self, P: np.ndarray) -> np.ndarray:
        totals = np.maximum(self.totals, _EPS)[:, None]
        p = np.maximum(self.spread(P) / totals, _EPS)
        dkl = (1.0 + np.log(p * self.m)) / totals  # Eq. 9 per stage and host
        return dkl[self.groups] + self.cache_weight * self.cost_rows


def disperse(problem: DispersionProblem, config: SchedulerConfig | None = None) -> DispersionResult:
    """Projected gradient descent of the KL objective from the greedy start; see the module docstring."""
    cfg = config or SchedulerConfig()
    groups = problem.groups
    feasible_rows = problem.feasible[groups].astype(bool)
    capacity = problem.capacity.astype(float)
    if len(groups) == 0:
        empty = np.zeros((0, problem.existing.shape[1]))
        return DispersionResult(empty, np.zeros_like(problem.existing, dtype=float), (), (), 0, True)

    objective = _Objective(problem, cfg.cache_weight)
    project = _Projector(feasible_rows, capacity, cfg.projection_rounds)
    # Start from the greedy plan, smoothed so every feasible host has some mass (log P stays finite).
    greedy_rows = problem.initial[groups] / np.maximum(problem.requested[groups], 1)[:, None]
    uniform_rows = feasible_rows / np.maximum(feasible_rows.sum(axis=1, keepdims=True), 1)
    P = project(0.9 * greedy_rows + 0.1 * uniform_rows)

    value = objective.value(P)
    kl_hist, obj_hist = [objective.kl(P)], [value]
    alpha, converged, iterations = cfg.learning_rate, False, 0
    while iterations < cfg.max_iterations:
        if kl_hist[-1] <= cfg.kl_threshold and cfg.cache_weight == 0:
            converged = True
            break
        iterations += 1
        grad = objective.gradient(P)
        while True:
            candidate = project(P - alpha * grad)
            new_value = objective.value(candidate)
            if new_value < value or alpha < 1e-10:
                break
            alpha /= 2
        improvement = value - new_value
        if improvement <= 0:
            converged = True  # no descent direction left within the constraints
            break
        P, value = candidate, new_value
        kl_hist.append(objective.kl(P))
        obj_hist.append(value)
        alpha = min(cfg.learning_rate, alpha * 2)
        if improvement < cfg.tolerance * max(1.0, abs(value)):
            converged = True
            break
        window = cfg.stall_window
        if window and len(obj_hist) > window and obj_hist[-1 - window] - value < cfg.stall_fraction * (obj_hist[0] - value):
            converged = True  # the last `window` steps did almost nothing: the tail changes no placement
            break
    expected = objective.onehot.T @ P
    return DispersionResult(P, expected, tuple(kl_hist), tuple(obj_hist), iterations, converged)


def round_expected(
    expected: np.ndarray,
    requested: np.ndarray,
    capacity: np.ndarray,
    feasible: np.ndarray,
    cold_cost: np.ndarray,
) -> np.ndarray:
    """Integer replicas per (stage, host) from expected counts, never above a host's free slots.

    One replica at a time goes to the (stage, host) whose expected count exceeds what it already
    got by the most (largest remainder); ties prefer cached hosts, then more free slots, then the
    lower index, so the result is deterministic. Replicas that find no slot stay unassigned.
    """
    S, M = expected.shape
    counts = np.zeros((S, M), dtype=int)
    left = requested.astype(int).copy()
    cap = capacity.astype(int).copy()
    while left.sum() > 0:
        candidates = [
            (-round(float(expected[s, j] - counts[s, j]), 9), float(cold_cost[s, j]), -int(cap[j]), s, j)
            for s in range(S)
            if left[s] > 0
            for j in range(M)
            if feasible[s, j] and cap[j] > 0
        ]
        if not candidates:
            break
        *_, s, j = min(candidates)
        counts[s, j] += 1
        left[s] -= 1
        cap[j] -= 1
    return counts
