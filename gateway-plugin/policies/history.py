"""Time-stamped samples a stateful policy keeps (pure: time comes from the snapshots it is fed)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class SampleWindow:
    """(time, value) samples kept for ``horizon_s`` seconds; window means and maxima over the tail."""

    horizon_s: float
    samples: deque = field(default_factory=deque)

    def add(self, time: float, value: float) -> None:
        self.samples.append((time, value))
        while self.samples and self.samples[0][0] < time - self.horizon_s:
            self.samples.popleft()

    def _tail(self, window_s: float) -> list[float]:
        if not self.samples:
            return []
        now = self.samples[-1][0]
        return [v for t, v in self.samples if t > now - window_s - 1e-9]

    def mean(self, window_s: float) -> float:
        tail = self._tail(window_s)
        return sum(tail) / len(tail) if tail else 0.0

    def max(self, window_s: float) -> float:
        tail = self._tail(window_s)
        return max(tail) if tail else 0.0
