"""Admission by time (issue 14, item 3): who gets in, and when to come back. (Admission by bytes, the
embedded gateway's body gate, is :mod:`quart_provider.body_gate`.)

- **Time**: :func:`admit_by_time` refuses a request at entry when the time it can expect (its body's
  transfer at the measured ingest rate, the queue ahead of it × the measured service time ÷ the replicas
  serving, its own service time; service times are the p90 of recent ones, :class:`ServiceTimes`), times
  a safety factor, exceeds its deadline: it would be answered 504 after holding memory and a queue slot.
  429 with ``Retry-After`` = how long the queue needs to drain to where the request would fit. A deadline
  below what the function has *ever* taken (its fastest recent call, or a floor before anything was
  measured) cannot be met under any load: 400 naming ``X-Quart-Timeout-Ms`` (retrying would not help).
  Pure (time is passed in): the gateway's proxy and the pipeline router both call it.
- **Deadline**: :func:`client_deadline_s` reads the client's ``X-Quart-Timeout-Ms`` (one parser for the
  proxy and the router: a value that is not a positive number is a 400 naming the header).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from quart_stage.errors import QuartError

DEADLINE_HEADER = "X-Quart-Timeout-Ms"
MAX_RETRY_AFTER_S = 60


def retry_after_s(seconds: float, fallback: int = 1) -> int:
    """Whole seconds to wait (1 … 60); ``fallback`` when the estimate is not a finite number."""
    if not math.isfinite(seconds) or seconds <= 0:
        return max(1, fallback)
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))


def client_deadline_s(headers: Mapping[str, str], cap_s: float) -> float | None:
    """The client's deadline (``X-Quart-Timeout-Ms``) in seconds, at most ``cap_s``; None when it sent none.

    Raises a 400 :class:`QuartError` naming the header when the value is not a positive finite number."""
    raw = headers.get(DEADLINE_HEADER)
    if raw is None or raw == "":
        return None
    try:
        deadline = float(raw) / 1000.0
    except ValueError:
        deadline = -1.0
    if not math.isfinite(deadline) or deadline <= 0:
        raise QuartError(400, f"{DEADLINE_HEADER} must be a positive number of milliseconds, got {raw[:40]!r}",
                         DEADLINE_HEADER)
    return min(deadline, cap_s)


@dataclass(slots=True)
class ServiceTimes:
    """Recent service times of one function or stage (seconds): the p90 admission plans with, the minimum
    below which no deadline can be met."""

    samples: deque = field(default_factory=lambda: deque(maxlen=64))

    def record(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.samples.append(seconds)

    def p90(self) -> float:
        """0 when nothing was measured."""
        if not self.samples:
            return 0.0
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]

    def fastest(self) -> float:
        return min(self.samples, default=0.0)


@dataclass(slots=True)
class RateMeter:
    """Bytes per second of body transfers (moving average of per-transfer rates; ``min_bytes`` and larger)."""

    min_bytes: int = 1 << 20
    rate: float = 0.0  # 0 = not measured yet

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes < self.min_bytes or seconds <= 0:
            return
        sample = nbytes / seconds
        self.rate = sample if self.rate <= 0 else 0.7 * self.rate + 0.3 * sample

    def seconds(self, nbytes: int | None) -> float:
        """Expected transfer time of ``nbytes`` (0 when unknown or not measured)."""
        return nbytes / self.rate if nbytes and self.rate > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StageLoad:
    """One queue as admission sees it: requests waiting, replicas serving, measured seconds per request."""

    queued: int  # waiting, not yet served
    servers: int  # requests served at once (replicas × their concurrency); 0 = none ready yet
    service_s: float  # measured (p90) service time of one request; 0 = not measured yet
    fastest_s: float = 0.0  # the fastest recent service time; 0 = not measured
    busy: bool = False  # every server is serving now: even an empty queue means a wait


@dataclass(frozen=True, slots=True)
class Admission:
    """The decision: ``admit``, else the status (429, or 400 for a deadline no load can meet), its
    ``retry_after_s`` (429) and why."""

    admit: bool
    expected_wait_s: float = 0.0
    retry_after_s: int = 0
    reason: str = ""
    status: int = 429

    def error(self) -> QuartError:
        if self.status != 429:
            return QuartError(self.status, self.reason, "X-Quart-Timeout-Ms")
        return QuartError(429, self.reason, None, {"Retry-After": str(self.retry_after_s)})


def expected_wait_s(load: StageLoad) -> float:
    """(Queue, plus one when every server is busy) × service time ÷ servers; 0 when it cannot be estimated
    (nothing measured, nobody serving: a cold start is bounded by the start timeout instead)."""
    if load.service_s <= 0 or load.servers <= 0:
        return 0.0
    return (load.queued + (1 if load.busy else 0)) * load.service_s / load.servers


def admit_by_time(stages: Sequence[StageLoad], deadline_s: float, what: str = "the request", transfer_s: float = 0.0,
                  safety: float = 1.0, floor_s: float = 0.0) -> Admission:
    """Admit unless ``safety`` × (``transfer_s`` + the expected wait and service over ``stages``) exceeds
    ``deadline_s`` (429), or ``deadline_s`` is below the fastest the stages have served (or ``floor_s``): 400."""
    if deadline_s <= 0:
        return Admission(True)
    fastest = max(floor_s, sum(s.fastest_s for s in stages))
    if deadline_s < fastest:
        return Admission(False, fastest, 0, f"X-Quart-Timeout-Ms of {1000 * deadline_s:g} ms is shorter than "
                         f"{what} has ever taken ({1000 * fastest:.1f} ms at the fastest): it cannot be met; send a "
                         "longer deadline", 400)
    waits = [expected_wait_s(s) for s in stages]
    total = safety * (transfer_s + sum(waits) + sum(s.service_s for s in stages if s.service_s > 0))
    if total <= deadline_s:
        return Admission(True, total)
    excess = total - deadline_s  # the queue drains at servers / service_s requests per second
    return Admission(False, total, retry_after_s(excess),
                     f"{what} would take about {total:.2f} s, over its deadline of {deadline_s:.2f} s; retry later")
