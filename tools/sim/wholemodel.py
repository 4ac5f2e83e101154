"""The whole-model data plane of the simulator (INFless as the paper ran it): a request holds one replica of
every stage for the whole model's time, no pipelining (``SimConfig.whole_model``)."""

from __future__ import annotations

from collections.abc import Callable

from quart_tools.sim.dataplane import admit
from quart_tools.sim.events import COMPLETE, EventLoop
from quart_tools.sim.state import Replica, SimConfig, Tally, _Stage


class WholeModelFlow:
    """Arrival, start, completion and dispatch of whole-model requests; stage 0's queue is the model's."""

    def __init__(self, cfg: SimConfig, stages: list[_Stage], loop: EventLoop, tally: Tally,
                 release: Callable[[Replica, float], None]) -> None:
        self.cfg, self.stages, self.loop, self.tally, self.release = cfg, stages, loop, tally, release
        self.hops_s = cfg.hop_s * len(stages)

    def arrive(self, req: int, now: float) -> None:
        if not admit(self.stages, self.cfg.queue_cap, self.tally):
            return
        for st in self.stages:
            st.metrics.on_arrival(now, st.spec.activation_bytes)
        self.stages[0].arrivals.append(now)
        q = self.stages[0].queue
        if not q and all(st.free for st in self.stages):
            self._start(req, now, now)
        else:
            q.append((req, now))

    def _start(self, req: int, now: float, enqueued: float) -> None:
        reps, total = [], 0.0
        for st in self.stages:
            rep = st.free.pop()
            st.busy += 1
            rep.in_flight += 1
            st.metrics.on_dispatch(now, now - enqueued)
            reps.append(rep)
            total += st.spec.service_s * rep.factor * st.draws[req]
        total += self.hops_s
        self.loop.push(now + total, COMPLETE, (req, reps, now))

    def complete(self, payload: tuple[int, list[Replica], float], now: float) -> None:
        req, reps, _started = payload
        for st, rep in zip(self.stages, reps, strict=True):
            st.metrics.on_complete(now, st.spec.service_s * rep.factor * st.draws[req])
            st.busy -= 1
            rep.in_flight -= 1
            if rep.state == "draining":
                self.release(rep, now)
            else:
                st.free.append(rep)
        self.tally.latency[req] = (now - self.tally.arrival[req] + self.cfg.outside_s) * 1000.0
        self._dispatch(now)

    def on_ready(self, stage: _Stage, rep: Replica, now: float) -> None:
        """A replica is loaded: it joins its stage's free replicas; a whole set may start the next request."""
        stage.free.append(rep)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        q = self.stages[0].queue
        while q and all(st.free for st in self.stages):
            req, enq = q.popleft()
            self._start(req, now, enq)
