"""The discrete-event simulator of a pipelined model on a GPU cluster: one run of one policy over one arrival
schedule, on simulated time.

`Simulation` composes collaborators, one per responsibility, over shared records (`quart_tools.sim.state`):

- `events.EventLoop`: simulated time and the event heap (this module runs the loop: arrivals and events in
  time order, each event to the collaborator that owns its kind);
- the data plane: `dataplane.StageFlow` (a request walks the stages, one queue per stage, live replicas'
  partial requests) or, with ``whole_model=True``, `wholemodel.WholeModelFlow` (INFless as the paper ran it: a
  request holds one replica of every stage for the whole model's time);
- `starting.ReplicaStarts`: replicas placed, started by their mechanism (gpu / fork / cold; with
  ``start_mechanisms`` also peer / multicast / live / paraserve), ready, stopped, released;
- `control.ControlLoop`: the live `Controller` over this platform every control period, then the live
  reconciler's one convergence (`quart_kernel.convergence.converge`).

`state.Tally` collects what the run produced; `run` turns it into a `SimResult`.
"""

from __future__ import annotations

import math

import numpy as np
from quart_kernel.scheduling import SchedulerConfig, make_placer
from quart_tools.arrivals import Arrivals
from quart_tools.sim.cluster import Host, make_hosts
from quart_tools.sim.control import ControlLoop, SimActuator
from quart_tools.sim.dataplane import StageFlow
from quart_tools.sim.events import (
    COMPLETE,
    CONSOLIDATED,
    CONTROL,
    KICK,
    LIVE_FIRST,
    PARTIAL_DONE,
    READY,
    RECONCILE,
    EventLoop,
)
from quart_tools.sim.generation import GenerationFlow, session_lengths
from quart_tools.sim.starting import ReplicaStarts
from quart_tools.sim.state import SimConfig, SimResult, StageSpec, Tally, _Stage
from quart_tools.sim.wholemodel import WholeModelFlow

__all__ = ["SimActuator", "SimConfig", "SimResult", "Simulation", "StageSpec"]


class Simulation:
    """One run of one policy over one arrival schedule."""

    def __init__(self, cfg: SimConfig, policy, arrivals: Arrivals) -> None:
        if cfg.whole_model and (cfg.start_mechanisms or cfg.generation):
            raise ValueError("whole_model: not with start_mechanisms or generation (they need stages)")
        self.cfg, self.policy, self.arrivals = cfg, policy, arrivals
        cal = cfg.calibration
        self.hosts: list[Host] = make_hosts(cal.hosts, cal.gpus_per_host, cal.host_memory_bytes, cfg.keysmanager,
                                            cal.eviction_threshold)
        placer = make_placer(cfg.placer, SchedulerConfig())  # defaults, never the QUART_SCHED_* environment
        n = len(arrivals)
        rng = np.random.default_rng(cfg.seed)
        cv = cal.service_cv
        self.stages: list[_Stage] = []
        for i, spec in enumerate(cfg.stages):
            if cv > 0:
                shape = 1.0 / (cv * cv)
                draws = rng.gamma(shape, 1.0 / shape, size=n).tolist()
            else:
                draws = [1.0] * n
            self.stages.append(_Stage(i, spec, cfg.window_s, draws, cfg.cpus))
        self.loop = EventLoop()
        self.tally = Tally(arrivals.times.astype(float))
        self.starts = ReplicaStarts(cfg, self.stages, self.hosts, self.loop, self.tally)
        self.flow: StageFlow | WholeModelFlow | GenerationFlow
        if cfg.generation:
            prompt, new = session_lengths(arrivals, cfg.max_context, cfg.max_new_tokens)
            self.flow = GenerationFlow(cfg, self.stages, self.loop, self.tally, self.starts.release, prompt, new)
        else:
            flow = WholeModelFlow if cfg.whole_model else StageFlow
            self.flow = flow(cfg, self.stages, self.loop, self.tally, self.starts.release)
        self.control = ControlLoop(cfg, policy, self.stages, self.hosts, self.loop, self.tally, self.starts, placer)
        if cfg.generation:  # the sessions' floor reads the sessions and decode steps, as the live engine's
            self.control.controller.generation = self.flow
        self.starts.flow, self.starts.converge = self.flow, self.control.converge
        for st in self.stages:
            st.desired = cfg.initial_replicas
        self.starts.place_initial(placer)

    @property
    def now(self) -> float:
        return self.loop.now

    def run(self) -> SimResult:
        cfg, loop, tally = self.cfg, self.loop, self.tally
        times = tally.arrival.tolist()
        n = len(times)
        horizon = (times[-1] if n else 0.0) + cfg.drain_s
        loop.push(0.0, CONTROL, None)
        flow, starts, control = self.flow, self.starts, self.control
        handlers = {COMPLETE: flow.complete, READY: starts.ready, RECONCILE: lambda _none, t: control.reconcile(t),
                    LIVE_FIRST: getattr(flow, "live_first", None), PARTIAL_DONE: getattr(flow, "partial_done", None),
                    CONSOLIDATED: starts.consolidated, KICK: lambda _none, t: control.step(t, kicked=True)}
        complete, heap, pop, arrive = flow.complete, loop.heap, loop.pop, flow.arrive
        i = 0
        events = 0
        while True:
            next_arrival = times[i] if i < n else math.inf
            if heap and heap[0][0] <= next_arrival:
                t, _, kind, payload = pop()
                if t > horizon:
                    break
                loop.now = t
                events += 1
                if kind == COMPLETE:
                    complete(payload, t)
                elif kind == CONTROL:
                    control.step(t)
                    if i < n or any(s.busy or s.queue or s.waiting for s in self.stages):
                        loop.push(t + cfg.control_period_s, CONTROL, None)
                else:
                    handlers[kind](payload, t)
            elif i < n:
                loop.now = next_arrival
                events += 1
                arrive(i, next_arrival)
                i += 1
            else:
                break
        return self._result(events)

    def _result(self, events: int) -> SimResult:
        cfg, tally = self.cfg, self.tally
        end = self.loop.now
        for h in self.hosts:  # slots still held at the end (starting, ready or draining replicas)
            for slot in h.slots:
                if slot.replica is not None:
                    tally.gpu_seconds += end - slot.replica.requested_at
                    tally.cpu_seconds += (end - slot.replica.requested_at) * slot.replica.cpus + slot.replica.cpu_extra_s
        n = len(tally.arrival)
        return SimResult(
            model=cfg.model,
            policy=getattr(self.policy, "name", type(self.policy).__name__),
            latencies_ms=tally.latency,
            arrival_s=tally.arrival,
            duration_s=float(tally.arrival[-1]) if n else 0.0,
            end_s=end,
            samples=tally.samples,
            stage_arrivals={st.index: st.arrivals for st in self.stages},
            starts_by_source=tally.starts_by_source,
            ready_s_by_source=tally.ready_s_by_source,
            rejected=tally.rejected,
            key_stage_counts=tally.key_counts,
            gpu_seconds=tally.gpu_seconds,
            cpu_seconds=tally.cpu_seconds,
            evictions=sum(h.evictions for h in self.hosts),
            events=events,
            decisions=tally.decisions,
            launched=tally.launched,
            paraserve_plans=tally.paraserve_plans,
            ttft_ms=tally.ttft_ms,
            tpot_ms=tally.tpot_ms,
            token_gaps=None if tally.token_gaps is None else np.array(tally.token_gaps, dtype=float).reshape(-1, 2),
            kv_migrations=tally.kv_migrations,
            kicks=self.control.controller.kicker.kicks,
        )
