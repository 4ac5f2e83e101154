"""The simulator's clock and event queue: simulated time and a binary heap of (time, sequence, kind, payload).

A plain heap (heapq) rather than SimPy processes: the Fig. 7 sweep is 175 ten-minute runs of up to a million
stage visits each, and a heap of tuples is several times faster. The sequence number orders events of equal
time by when they were pushed, so a run is deterministic for its seed.
"""

from __future__ import annotations

import heapq
from typing import Any

# The kinds of event (the engine dispatches them to the collaborator that owns each).
COMPLETE = 0  # a request's service on a replica ends (the data plane)
READY = 1  # a replica is loaded (replica starts)
CONTROL = 2  # one control period (the control loop)
RECONCILE = 3  # the gateway's periodic reconcile retries what was not placed (the control loop)
LIVE_FIRST = 4  # a live start's first layer is in: it takes requests (the data plane)
PARTIAL_DONE = 5  # a live replica ran its prefix of a request (the data plane)
CONSOLIDATED = 6  # a ParaServe group holds the whole stage on each kept worker (replica starts)
KICK = 7  # traffic kicked a decision before the next period (the control loop; gateway_plugin.kick)


class EventLoop:
    """Simulated time and the events still to come."""

    __slots__ = ("heap", "seq", "now")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.now = 0.0

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def pop(self) -> tuple[float, int, int, Any]:
        return heapq.heappop(self.heap)
