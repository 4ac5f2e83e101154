"""Where a start's time goes: named phases, each the seconds since the one before (logged by `quartctl up`).

The first phase, ``process``, is the time from the process's creation (interpreter start and imports) to
the :class:`Phases` object's creation, read from ``/proc/self/stat``; 0 where that cannot be read.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


def process_age_s() -> float:
    """Seconds since this process was created (Linux); 0.0 where unknown."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime_s = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclass(slots=True)
class Phases:
    """Named durations in order; ``mark(name)`` ends the phase that began at the previous mark."""

    durations: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.durations["process"] = round(process_age_s(), 3)

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.durations[name] = round(now - self._last, 3)
        self._last = now

    @property
    def total_s(self) -> float:
        return round(sum(self.durations.values()), 3)

    def __str__(self) -> str:
        return f"{self.total_s:.2f} s (" + ", ".join(f"{k} {v:.2f}" for k, v in self.durations.items()) + ")"
