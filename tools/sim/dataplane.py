"""The pipelined data plane of the simulator: a request walks the stages, one FIFO queue per stage (the
router's), dispatched to a free replica slot; live replicas' partial requests and their remainders.

Service times are the stage's profiled time × the CPU effect × a gamma draw per (request, stage), so every
policy sees the same request sizes (common random numbers). Requests are admitted or refused (429) only at
the pipeline's entry, as by the live router.

A live (BlitzScale) replica takes requests from its stage's queue from its first layer on, runs the prefix of
layers it holds (the fraction of layers arrived when it starts the request) and hands the rest of the request's
compute (plus one hop) to a full replica of the stage, which takes these remainders before new requests.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from quart_tools.sim.batching import start_batch
from quart_tools.sim.events import COMPLETE, PARTIAL_DONE, EventLoop
from quart_tools.sim.state import Replica, SimConfig, Tally, _Stage


def admit(stages: list[_Stage], queue_cap: int, tally: Tally) -> bool:
    """The live router's admission, at the pipeline's entry only: 429 when any stage's queue is full."""
    if any(len(st.queue) >= queue_cap for st in stages):
        tally.rejected += 1  # the request ends here, its latency stays NaN
        return False
    return True


def leave_live_pool(stage: _Stage, rep: Replica) -> None:
    """A live replica holds every layer now (or stops): it leaves the live pool."""
    rep.live = False
    if rep in stage.live_free:
        stage.live_free.remove(rep)


class StageFlow:
    """Arrival, dispatch, service and completion of requests, stage by stage."""

    def __init__(self, cfg: SimConfig, stages: list[_Stage], loop: EventLoop, tally: Tally,
                 release: Callable[[Replica, float], None]) -> None:
        self.cfg, self.stages, self.loop, self.tally = cfg, stages, loop, tally
        self.release = release  # the replica starts' release of a drained replica's slot
        # A hop either holds the replica (added to each stage visit, measured as service time, as the live
        # router times its whole call) or is a constant added to the end-to-end latency.
        self.hop_in_service = cfg.hop_s if cfg.hop_holds_replica else 0.0
        self.hops_after = (0.0 if cfg.hop_holds_replica else cfg.hop_s * len(stages)) + cfg.outside_s
        self.hop_per_call = cfg.hop_per_call_s  # + this per stage call in flight (the host's CPU contention)
        self.dispatch = cfg.dispatch_s  # + this when a freed replica takes the next waiting request

    # ------------------------------------------------------------------------- whole replicas
    def arrive(self, req: int, now: float) -> None:
        """A request arrives at the pipeline's entry."""
        self._arrive(req, self.stages[0], now)

    def _arrive(self, req: int, stage: _Stage, now: float) -> None:
        if stage.index == 0 and not admit(self.stages, self.cfg.queue_cap, self.tally):
            return
        stage.metrics.on_arrival(now, stage.spec.activation_bytes)
        stage.arrivals.append(now)
        if stage.free:
            self._start(req, stage, stage.free.pop(), now, now)
        elif stage.live_free:
            self._partial(req, stage, stage.live_free.pop(), now, now)
        else:
            stage.queue.append((req, now))

    def _start(self, req: int, stage: _Stage, rep: Replica, now: float, enqueued: float, dispatch: float = 0.0) -> None:
        """``req``'s call on ``rep``; it starts ``dispatch`` s from now (the replica held meanwhile), and its wait
        and service are the router's: from its enqueueing to the call's start, from the start to the answer."""
        stage.metrics.on_dispatch(now + dispatch, now + dispatch - enqueued)
        stage.busy += 1
        rep.in_flight += 1
        service = stage.spec.service_s * rep.factor * stage.draws[req] + self.hop_in_service
        if self.hop_per_call:
            service += self.hop_per_call * sum(st.busy for st in self.stages)
        loop = self.loop
        loop.seq += 1
        heapq.heappush(loop.heap, (now + dispatch + service, loop.seq, COMPLETE, (req, rep, service)))

    def complete(self, payload: tuple[int | tuple[int, ...], Replica, float], now: float) -> None:
        """A call on a replica ended (a `COMPLETE` event): one request's, or a batch's (quart_tools.sim.batching)."""
        req, rep, service = payload
        reqs = req if isinstance(req, tuple) else (req,)
        stage = self.stages[rep.stage]
        for _ in reqs:
            stage.metrics.on_complete(now, service)
        stage.metrics.on_batch(len(reqs), service)  # the router's service time by batch size
        stage.busy -= len(reqs)
        rep.in_flight -= 1
        if rep.first_done < 0:
            rep.first_done = now
        if rep.state == "draining":
            self.release(rep, now)
        else:
            self.serve_next(stage, rep, now)
        for r in reqs:
            self._advance(r, rep.stage, now)

    def _advance(self, req: int, index: int, now: float) -> None:
        """A request is done with stage ``index``: on to the next stage, or finished."""
        if index + 1 < len(self.stages):
            self._arrive(req, self.stages[index + 1], now)
        else:
            self.tally.latency[req] = (now - self.tally.arrival[req] + self.hops_after) * 1000.0

    def serve_next(self, stage: _Stage, rep: Replica, now: float) -> None:
        """A replica is free: it takes the oldest remainder of a live replica's request, else the oldest waiting
        request of its stage, or goes idle."""
        if stage.remainders:
            self._start_remainder(stage, rep, now)
        elif stage.queue and self.cfg.batch_max > 1:
            start_batch(self.cfg, self.loop, self.hop_in_service, stage, rep, now)
        elif stage.queue:
            req, enq = stage.queue.popleft()
            self._start(req, stage, rep, now, enq, self.dispatch)
        else:
            stage.free.append(rep)

    def on_ready(self, stage: _Stage, rep: Replica, now: float) -> None:
        """A replica is loaded: it serves (a live one still running its part of a request takes the next then)."""
        if not rep.in_flight:
            self.serve_next(stage, rep, now)

    def before_consolidated(self, rep: Replica, now: float) -> None:
        """A ParaServe group consolidates: nothing moves (a one-shot request holds no state between passes)."""

    # --------------------------------------------------------------------------------- live
    def live_first(self, rep: Replica, now: float) -> None:
        """A live start's first layer is in (a `LIVE_FIRST` event): it takes requests from now on."""
        if rep.state != "starting":
            return
        rep.live = True
        self._live_next(self.stages[rep.stage], rep, now)

    def _live_next(self, stage: _Stage, rep: Replica, now: float) -> None:
        """A live (partly loaded) replica is free: it takes the oldest waiting request, or waits."""
        if stage.queue:
            req, enq = stage.queue.popleft()
            self._partial(req, stage, rep, now, enq)
        else:
            stage.live_free.append(rep)

    def _partial(self, req: int, stage: _Stage, rep: Replica, now: float, enqueued: float) -> None:
        stage.metrics.on_dispatch(now, now - enqueued)
        stage.busy += 1
        rep.in_flight += 1
        held = min(rep.layers, max(1, math.floor((now - rep.layer0) / rep.layer_dt) + 1))
        fraction = held / rep.layers
        full = stage.spec.service_s * rep.factor * stage.draws[req]
        part = fraction * full + self.hop_in_service
        self.loop.push(now + part, PARTIAL_DONE, (req, rep, full - fraction * full, part))

    def partial_done(self, payload: tuple[int, Replica, float, float], now: float) -> None:
        """A live replica ran its prefix of a request (a `PARTIAL_DONE` event); the rest waits for a full one."""
        req, rep, remainder, part = payload
        stage = self.stages[rep.stage]
        stage.busy -= 1
        rep.in_flight -= 1
        if rep.first_done < 0:
            rep.first_done = now
        if remainder <= 0:
            stage.metrics.on_complete(now, part)
            self._advance(req, rep.stage, now)
        else:
            stage.remainders.append((req, remainder + self.hop_in_service, part))
            if stage.free:
                self.serve_next(stage, stage.free.pop(), now)
        if rep.state == "draining":
            self.release(rep, now)
        elif rep.state == "ready":
            self.serve_next(stage, rep, now)
        elif rep.live:
            self._live_next(stage, rep, now)

    def _start_remainder(self, stage: _Stage, rep: Replica, now: float) -> None:
        """A full replica runs the layers a live replica did not hold, for the oldest such request."""
        req, remainder, part = stage.remainders.popleft()
        stage.busy += 1
        rep.in_flight += 1
        self.loop.push(now + remainder, COMPLETE, (req, rep, remainder + part))
