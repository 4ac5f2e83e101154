"""A replica's capacity when the router batches its calls (issue 28; docs/policies.md "Batching").

A call carrying b requests takes S(b) = F + P·b seconds (F: what a call costs whatever it carries — dispatch,
HTTP, the weights' pass; P: each request's own share). F and P are a least-squares fit of the stage's table of
service time by batch size (``StageSnapshot.batch_service_s``: the router's measurements, merged with the
profile of the ``com.quart.batch.profile-ms`` label where nothing was measured yet), each size weighted by its
calls. One replica then serves μ(b) = b / S(b) requests/s.

The batch that forms: a replica that frees takes what waits, and a departure sees the mean queue (Poisson
arrivals), so b* solves b = L_q(λ, μ(b), c) = λ·W_q(λ, μ(b), c), clamped to [1, B] (B: ``com.quart.batch.max``;
L_q falls as b grows, so the root is one, found by bisection). The stage's delay is the M/M/c wait at the
service rate of that batch plus the batch's own time:

    T(λ, c) = C(c, λ/μ(b*)) / (c·μ(b*) − λ) + S(b*)

At b* = 1 this is M/M/c with μ = 1/S(1) (a stage that does not batch is the plain model); its capacity is
c·μ(B). Sizing for a delay target T* (the stability floor, a backlog's drain) counts on the largest batch whose
call fits half of it, b_T = max{b ≤ B: S(b) ≤ T*/2}: a profile with a small F (CPU: batches save little) gains
capacity only at a latency the target does not allow. A stage with B ≤ 1 or no measured service time is left to the plain model (``stage.service_rate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway_plugin.policies.queueing import mmc_wait
from gateway_plugin.snapshot import StageSnapshot

__all__ = ["BatchProfile", "capacity_rate", "delay_s", "fit", "profile_of", "service_rate_at", "work_s"]


@dataclass(frozen=True, slots=True)
class BatchProfile:
    """S(b) = fixed_s + per_request_s · b for b ≤ max_batch."""

    fixed_s: float
    per_request_s: float
    max_batch: int

    def service_s(self, batch: float) -> float:
        """Seconds one call of ``batch`` requests takes."""
        return self.fixed_s + self.per_request_s * batch

    def rate(self, batch: float) -> float:
        """Requests/s of one replica serving calls of ``batch`` requests back to back."""
        return batch / self.service_s(batch)

    def expected_batch(self, arrival_rate: float, servers: int) -> float:
        """b* in [1, max_batch]: the batch a freeing replica takes, the mean queue L_q it sees at that batch's rate."""
        if arrival_rate <= 0 or servers <= 0:
            return 1.0
        def excess(b: float) -> float:  # L_q(b) − b, decreasing in b (bigger batches serve faster, queue less)
            return min(self.max_batch + 1.0, arrival_rate * mmc_wait(arrival_rate, self.rate(b), servers)) - b
        lo, hi = 1.0, float(self.max_batch)
        if excess(lo) <= 0:
            return lo
        if excess(hi) >= 0:
            return hi
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
        return (lo + hi) / 2


def fit(table: tuple[tuple[int, int, float], ...], max_batch: int) -> BatchProfile | None:
    """Weighted least squares of S(b) = F + P·b over ``(size, calls, mean s)``, F ≥ 0 and P ≥ 0; a calls count of 0
    (a profiled entry) weighs 1. One size alone: P = S(b)/b, F = 0 (no evidence of a gain yet)."""
    rows = [(float(b), max(1, n), s) for b, n, s in table if b >= 1 and s > 0]
    if not rows:
        return None
    w = sum(n for _, n, _ in rows)
    mb = sum(n * b for b, n, _ in rows) / w
    ms = sum(n * s for _, n, s in rows) / w
    var = sum(n * (b - mb) ** 2 for b, n, _ in rows)
    slope = sum(n * (b - mb) * (s - ms) for b, n, s in rows) / var if var > 0 else math.inf
    if not math.isfinite(slope) or slope <= 0 or ms - slope * mb < 0:
        slope, fixed = ms / mb, 0.0  # through the origin: no fixed cost to share
    else:
        fixed = ms - slope * mb
    return BatchProfile(fixed, slope, max(1, max_batch))


def profile_of(stage: StageSnapshot) -> BatchProfile | None:
    """The stage's batch profile, or None when it does not batch (``batch_max`` ≤ 1) or nothing is known."""
    if stage.batch_max <= 1:
        return None
    return fit(stage.batch_service_s, stage.batch_max)


def work_s(stage: StageSnapshot) -> float:
    """What one request costs a replica alone: S(1) of a batching stage's profile, else its mean service time (a
    request of a batch reports the whole call's time, which would weigh a stage by the batches it happened to
    form: SLO split, fair shares)."""
    profile = profile_of(stage)
    return stage.mean_service_s if profile is None else profile.service_s(1)


def service_rate_at(stage: StageSnapshot, arrival_rate: float, servers: int) -> float:
    """Requests/s of one server of the stage at the batch λ over ``servers`` forms (``stage.service_rate`` unbatched)."""
    profile = profile_of(stage)
    if profile is None:
        return stage.service_rate
    return profile.rate(profile.expected_batch(arrival_rate, servers))


def capacity_rate(stage: StageSnapshot, target_s: float = math.inf) -> float:
    """Requests/s of one server at the largest batch whose call fits half of ``target_s`` (a request may wait one
    call, then ride the next: S(b) ≤ target/2), at least 1; at full batches without a target: the most it can
    take (``stage.service_rate`` unbatched)."""
    profile = profile_of(stage)
    if profile is None:
        return stage.service_rate
    fits = (target_s / 2 - profile.fixed_s) / profile.per_request_s if profile.per_request_s > 0 else math.inf
    return profile.rate(profile.max_batch if fits >= profile.max_batch else max(1, math.floor(fits)))


def delay_s(stage: StageSnapshot, arrival_rate: float, servers: int) -> float:
    """T(λ, c): the M/M/c wait at μ(b*) plus S(b*) (plain M/M/c when the stage does not batch); inf when ρ ≥ 1."""
    profile = profile_of(stage)
    if profile is None:
        mu = stage.service_rate
        return math.inf if mu <= 0 else mmc_wait(arrival_rate, mu, servers) + 1.0 / mu
    batch = profile.expected_batch(arrival_rate, servers)
    return mmc_wait(arrival_rate, profile.rate(batch), servers) + profile.service_s(batch)
