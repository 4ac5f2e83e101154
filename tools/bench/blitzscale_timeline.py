"""The timeline of one ``quartctl bench blitzscale --workload generation`` mode: what the session engine held, every
``step_s`` from the scale-up's t0 (issue 29: where the live replica's capacity goes during its loading).

Each sample (the columns of ``COLS``): seconds from t0, ``f`` (the share of its stage the new replica holds, 0
before it is ready), sessions admitted since t0 (cumulative), waiting in the entry's line, active, active split,
KV positions booked on the old and on the new replica (in sessions of ``need`` positions), and the mean step time
(ms) of the split and of the whole sessions' decode tokens that came in that interval. Compact: one list per
sample, the columns named once.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from gateway_plugin import layers

COLS = ["t_s", "f", "admitted", "waiting", "active", "split", "old_booked", "new_booked", "split_step_ms",
        "whole_step_ms"]


def held_share(replica: Any) -> float:
    """The share of its stage's layers a replica holds now (1 for a whole one)."""
    stage, held = layers.stage_range(replica), layers.held_range(replica)
    if stage is None or held is None or layers.is_whole(replica):
        return 1.0
    return max(0, held[1] - stage[0]) / max(1, stage[1] - stage[0])


class Timeline:
    """Samples the engine every ``step_s`` until stopped; ``rows()`` the compact table."""

    def __init__(self, engine: Any, function: str, first: str, need: int, t0: float, clock: Any,
                 step_s: float = 0.25) -> None:
        self.engine, self.function, self.first, self.need = engine, function, first, need
        self.t0, self.clock, self.step_s = t0, clock, step_s
        self.admitted = 0  # sessions placed since t0 (the bench counts them)
        self.steps: list[tuple[float, bool, float]] = []  # (when, split, decode step seconds) of every token
        self.samples: list[list[float]] = []

    def step(self, at: float, split: bool, seconds: float) -> None:
        self.steps.append((at, split, seconds))

    def sample(self) -> None:
        now = self.clock()
        ready = self.engine.source.ready(self.function)
        new = [r for r in ready if r.id != self.first]
        f = max((held_share(r) for r in new), default=0.0)
        booked = self.engine.book.reserved
        old_b = booked.get(self.first, 0) / self.need
        new_b = sum(booked.get(r.id, 0) for r in new) / self.need
        active = list(self.engine.active.values())
        since = now - self.step_s
        split_ms = [1000 * s for at, sp, s in self.steps if at >= since and sp]
        whole_ms = [1000 * s for at, sp, s in self.steps if at >= since and not sp]
        self.samples.append([round(now - self.t0, 2), round(f, 3), self.admitted,
                             self.engine.room.waiting(self.function), len(active),
                             sum(1 for s in active if s.splits), round(old_b, 2), round(new_b, 2),
                             round(statistics.fmean(split_ms), 1) if split_ms else None,
                             round(statistics.fmean(whole_ms), 1) if whole_ms else None])

    async def run(self, until: asyncio.Event) -> None:
        while not until.is_set():
            self.sample()
            await asyncio.sleep(self.step_s)

    def table(self) -> dict:
        return {"cols": COLS, "rows": self.samples}


def fluid_bound(samples: list[list[float]], arrivals: Any, room: float, whole_s: float, split_s: float,
                waiting0: float = 0.0) -> dict:
    """The admissions the measured f(t) allows at most (``live_split.admission_rate``, a fluid FIFO line): from
    each sample's f, the arrivals since t0 (``arrivals(t)``, cumulative) and the line at t0, the sessions admitted
    by each sample's time and the longest wait in line the bound gives (a floor under the TTFT p99's wait)."""
    from quart_kernel.scheduling.live_split import admission_rate

    admitted, backlog, out, pending = 0.0, waiting0, [], []  # pending: (arrival count, arrival time) not yet admitted
    prev_t = 0.0
    longest = 0.0
    arrived_before = 0.0
    for row in samples:
        t, f = row[0], row[1]
        dt = max(0.0, t - prev_t)
        arrived = arrivals(t)
        backlog += arrived - arrived_before
        pending.append((waiting0 + arrived, t))
        take = min(backlog, admission_rate(f, room, whole_s, split_s) * dt)
        admitted += take
        backlog -= take
        while pending and pending[0][0] <= admitted + 1e-9:
            longest = max(longest, t - pending.pop(0)[1])
        out.append(round(admitted, 1))
        prev_t, arrived_before = t, arrived
    return {"admitted": out, "longest_wait_s": round(longest, 2), "left_waiting": round(backlog, 1)}
