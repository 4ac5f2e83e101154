"""Admission by bytes and by time (issue 14, item 3): who gets in, and when to come back.

- **Bytes**: :class:`ByteGate` bounds the request-body bytes held at once, per gateway and per function.
  A body is counted as it arrives (``Content-Length`` up front, a chunked body piece by piece), so a
  chunked body is bounded like any other. One body over the per-function bound can never pass: 413.
  A body that would take the total over a bound now: 429 with ``Retry-After`` from the measured drain
  rate (bytes released per second), never a constant.
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
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from quart_stage.errors import QuartError

DEADLINE_HEADER = "X-Quart-Timeout-Ms"
MAX_RETRY_AFTER_S = 60
_BUCKET_S = 0.1  # drain-rate resolution


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


class ByteGate:
    """Request-body bytes held at once, per gateway (``total_limit``) and per key (a function or model)."""

    def __init__(self, total_limit: int, key_limit: int, clock: Callable[[], float] = time.monotonic,
                 fallback_retry_s: int = 1, window_s: float = 10.0) -> None:
        self.total_limit = total_limit
        self.key_limit = key_limit
        self.clock = clock
        self.fallback_retry_s = fallback_retry_s
        self.window_s = window_s
        self.total = 0
        self.held: dict[str, int] = {}
        # bytes released within the window, in buckets of ``_BUCKET_S`` ([first release time, bytes]): the drain
        # rate; O(1) per release at any request rate (a list of every release was O(n) per request past 4,096)
        self._released: deque[list[float]] = deque()
        self._released_bytes = 0

    def drain_rate(self) -> float:
        """Bytes released per second over the last ``window_s`` (0 when nothing was)."""
        now = self.clock()
        self._trim(now)
        if not self._released:
            return 0.0
        span = max(now - self._released[0][0], 0.5)
        return self._released_bytes / span

    def _trim(self, now: float) -> None:
        released = self._released
        while released and now - released[0][0] > self.window_s:
            self._released_bytes -= int(released.popleft()[1])

    def refusal(self, key: str, size: int) -> QuartError | None:
        """Why ``size`` more bytes for ``key`` cannot be held now: 413 (never fits) or 429 + Retry-After."""
        held = self.held.get(key, 0)
        if size > self.key_limit:
            return QuartError(413, f"request body of {size} bytes is over the {self.key_limit}-byte in-flight limit "
                                   f"of {key!r}", "body")
        over = max(self.total + size - self.total_limit, held + size - self.key_limit)
        if over > 0:
            rate = self.drain_rate()
            wait = retry_after_s(over / rate if rate > 0 else math.nan, self.fallback_retry_s)
            scope = "the gateway" if self.total + size > self.total_limit else repr(key)
            return QuartError(429, f"{scope} already holds its limit of request bodies in flight; retry later",
                              None, {"Retry-After": str(wait)})
        return None

    def reserve(self, key: str, size: int) -> None:
        """Count ``size`` more bytes for ``key``; raises 413 (never fits) or 429 + Retry-After (not now)."""
        refusal = self.refusal(key, size)
        if refusal is not None:
            raise refusal
        held = self.held.get(key, 0)
        self.total += size
        self.held[key] = held + size

    def release(self, key: str, size: int) -> None:
        if size <= 0:
            return
        self.total -= size
        left = self.held.get(key, 0) - size
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)
        now = self.clock()
        released = self._released
        if released and now - released[-1][0] < _BUCKET_S:
            released[-1][1] += size
        else:
            released.append([now, size])
            self._trim(now)
        self._released_bytes += size


class Reservation:
    """Bytes of one request body held in a :class:`ByteGate` until :meth:`close` (idempotent)."""

    def __init__(self, gate: ByteGate, key: str) -> None:
        self.gate, self.key, self.size = gate, key, 0

    def add(self, size: int) -> None:
        if self.size + size > self.gate.key_limit:  # the whole body, however it arrives
            raise QuartError(413, f"request body of more than {self.gate.key_limit} bytes is over the in-flight "
                                  f"limit of {self.key!r}", "body")
        self.gate.reserve(self.key, size)
        self.size += size

    def hold(self, size: int) -> None:
        """Count ``size`` more bytes without refusing them (an answer already computed): later bodies see them."""
        self.gate.total += size
        self.gate.held[self.key] = self.gate.held.get(self.key, 0) + size
        self.size += size

    def close(self) -> None:
        self.gate.release(self.key, self.size)
        self.size = 0
