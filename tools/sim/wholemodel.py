"""The whole-model flow of the simulator (INFless as the paper ran it): a request holds one replica of every
stage for the whole model's time, no pipelining. A mixin of `quart_tools.sim.engine.Simulation`."""

from __future__ import annotations

import heapq

_COMPLETE = 0  # the engine's completion event


class WholeModelFlow:
    """Arrival, start, completion and dispatch of whole-model requests (``SimConfig.whole_model``)."""

    def _wm_arrive(self, req: int, now: float) -> None:
        if not self._admit():
            return
        for st in self.stages:
            st.metrics.on_arrival(now, st.spec.activation_bytes)
        self.stages[0].arrivals.append(now)
        q = self.stages[0].queue
        if not q and all(st.free for st in self.stages):
            self._wm_start(req, now, now)
        else:
            q.append((req, now))

    def _wm_start(self, req: int, now: float, enqueued: float) -> None:
        reps, total = [], 0.0
        for st in self.stages:
            rep = st.free.pop()
            st.busy += 1
            rep.in_flight += 1
            st.metrics.on_dispatch(now, now - enqueued)
            reps.append(rep)
            total += st.spec.service_s * rep.factor * st.draws[req]
        total += self.hops_s
        self.seq += 1
        heapq.heappush(self.heap, (now + total, self.seq, _COMPLETE, (req, reps, now)))

    def _wm_complete(self, req: int, reps: list, started: float, now: float) -> None:
        for st, rep in zip(self.stages, reps, strict=True):
            st.metrics.on_complete(now, st.spec.service_s * rep.factor * st.draws[req])
            st.busy -= 1
            rep.in_flight -= 1
            if rep.state == "draining":
                self._release(rep, now)
            else:
                st.free.append(rep)
        self.latency[req] = (now - self.arrival[req]) * 1000.0
        self._wm_dispatch(now)

    def _wm_dispatch(self, now: float) -> None:
        q = self.stages[0].queue
        while q and all(st.free for st in self.stages):
            req, enq = q.popleft()
            self._wm_start(req, now, enq)
