"""The scripted scale-up / scale-down sequence both placers receive in `quartctl bench scheduler`. Pure.

Bursts move between the key stages of a pipeline, as the corrector sees congestion move: at each step
a burst may end (its replicas are stopped) and a new one may start on a key stage that has none
(+1 or +2 replicas, held for a few steps). Seeded, so both placers get the very same sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Step:
    """Scale `function` by `delta` replicas (+ scale-up by the corrector, − scale-down)."""

    function: str
    delta: int


def scripted_sequence(
    key_stages: list[str],
    bursts: int,
    max_extra: int,
    seed: int = 0,
    max_burst: int = 2,
    max_hold: int = 3,
) -> list[Step]:
    """`bursts` scale-ups of the key stages, each undone after 1..`max_hold` steps.

    At most `max_extra` scale-up replicas are alive at once (what the cluster's free slots allow), and
    a stage never bursts twice at the same time. Every burst is scaled down by the end.
    """
    if not key_stages:
        raise ValueError("scripted_sequence needs at least one key stage")
    if max_extra < 1 or max_burst < 1:
        raise ValueError("max_extra and max_burst must be >= 1")
    rng = random.Random(seed)
    steps: list[Step] = []
    active: dict[str, tuple[int, int]] = {}  # function -> (replicas, steps left)
    started = 0
    while started < bursts or active:
        for function in sorted(active):
            n, left = active[function]
            if left <= 1 or started >= bursts:
                steps.append(Step(function, -n))
                del active[function]
            else:
                active[function] = (n, left - 1)
        if started >= bursts:
            continue
        room = max_extra - sum(n for n, _ in active.values())
        idle = [f for f in key_stages if f not in active]
        if room <= 0 or not idle:
            continue
        function = rng.choice(idle)
        n = min(room, rng.randint(1, max_burst))
        active[function] = (n, rng.randint(1, max_hold))
        steps.append(Step(function, n))
        started += 1
    return steps
