"""Admission by bytes (issue 14, item 3): :class:`ByteGate` bounds the request-body bytes held at once, per
gateway and per function. A body is counted as it arrives (``Content-Length`` up front, a chunked body piece by
piece), so a chunked body is bounded like any other. One body over the per-function bound can never pass: 413.
A body that would take the total over a bound now: 429 with ``Retry-After`` from the measured drain rate (bytes
released per second), never a constant. Admission by time is the kernel's (:mod:`quart_kernel.admission`)."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from quart_kernel.admission import retry_after_s
from quart_stage.errors import QuartError

_BUCKET_S = 0.1  # drain-rate resolution


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
