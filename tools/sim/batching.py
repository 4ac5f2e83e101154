"""Dynamic batching in the simulator (issue 28; docs/simulator.md "Batching"), as the live router does it.

With ``SimConfig.batch_max`` B > 1 a replica that frees takes up to B requests waiting at its stage in one call
(a replica that is idle when a request arrives takes it alone: no added wait, as ``gateway_plugin.batching``).
A call of b requests takes the stage's service time scaled by the batch profile,

    S(b) = S(1) · (f + (1 − f) · b),      f = ``SimConfig.batch_fixed`` = F / (F + P)

the same linear S(b) = F + P·b the policies fit (``gateway_plugin.policies.batch_capacity``), here relative to the
stage's own time; the mean of its members' service draws scales it, and the router's hop is paid once per call.
Each member records the call's time as its service time and the call records ``(b, S(b))`` in the stage's
``StageMetrics.on_batch``, so a policy sees the table the live router measures; the stage also carries the profile
as its ``com.quart.batch.profile-ms`` prior (``profile_s``). Whole-model mode and the parts of a live start run
one request a call.

The profile of ``--batching`` (``DEFAULT_FIXED``) is the one measured on MiniLM by ``quartctl bench batching``
(docs/data/batching.json: ``profile``); ``--batch-fixed`` sets another (e.g. a GPU's, where f is near 1).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from quart_tools.sim.events import COMPLETE, EventLoop

if TYPE_CHECKING:
    from quart_tools.sim.state import Replica, SimConfig, _Stage

DEFAULT_MAX = 16
DEFAULT_FIXED = 0.37  # F / S(1) of MiniLM's stage 1 on this machine's CPU (docs/benchmarks.md, batching)
PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def relative_time(batch: int, fixed: float) -> float:
    """S(b) / S(1) = f + (1 − f)·b."""
    return fixed + (1.0 - fixed) * batch


def profile_s(service_s: float, batch_max: int, fixed: float) -> tuple[tuple[int, float], ...]:
    """The stage's profile as a ``com.quart.batch.profile-ms`` label gives it: (size, seconds of one call)."""
    sizes = sorted({b for b in PROFILE_SIZES if b < batch_max} | {1, batch_max})
    return tuple((b, service_s * relative_time(b, fixed)) for b in sizes)


def start_batch(cfg: SimConfig, loop: EventLoop, hop_s: float, stage: _Stage, rep: Replica, now: float) -> None:
    """A freeing replica takes up to ``cfg.batch_max`` requests waiting at its stage in one call (the data plane's;
    ``hop_s``: the hop a call holds the replica for)."""
    members = []
    while stage.queue and len(members) < cfg.batch_max:
        req, enqueued = stage.queue.popleft()
        stage.metrics.on_dispatch(now, now - enqueued)
        members.append(req)
    stage.busy += len(members)
    rep.in_flight += 1  # one call
    draw = sum(stage.draws[r] for r in members) / len(members)
    service = stage.spec.service_s * rep.factor * draw * relative_time(len(members), cfg.batch_fixed) + hop_s
    loop.push(now + service, COMPLETE, (tuple(members), rep, service))


def batched_fifo_waits(arrivals: list[float], work: list[float], hop: float, servers: int, batch_max: int,
                       fixed: float) -> list[float]:
    """Waits in one FIFO queue served by ``servers`` batching replicas (arrivals sorted; ``work``: each request's
    time alone without the hop): an idle replica takes an arrival alone, a freeing one up to ``batch_max`` waiting."""
    free = [0.0] * servers
    waits = [0.0] * len(arrivals)
    i, n = 0, len(arrivals)
    while i < n:
        f = heapq.heappop(free)
        if arrivals[i] >= f:
            start, j = arrivals[i], i + 1
        else:
            start, j = f, i
            while j < n and j - i < batch_max and arrivals[j] <= f:
                j += 1
        size = j - i
        for k in range(i, j):
            waits[k] = start - arrivals[k]
        heapq.heappush(free, start + sum(work[i:j]) / size * relative_time(size, fixed) + hop)
        i = j
    return waits
