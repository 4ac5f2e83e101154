"""The discrete-event engine: gateway queues, stage replicas, the control loop, on simulated time.

One request walks the pipeline's stages; each stage has one FIFO queue (the router's) and dispatches
to a free replica slot. Service times are the stage's profiled time × the CPU effect × a gamma draw;
the draws are per (request, stage), so every policy sees the same request sizes (common random
numbers). Every ``control_period_s`` the live `gateway_plugin.controller.Controller` decides over this
simulated platform (it is the controller's Inventory and QueueView; `Controller.decide` is synchronous,
its changes are applied here as the embedded gateway's registry applies them): the same snapshot builder
over the live sliding-window metrics, the same policy, the same bounds (`replicaset.within_bounds`).
What follows a decision is the live reconciler's one convergence (`quart_kernel.convergence.converge`)
over this platform's view (functions, replicas, ParaServe groups, hosts): the shortfall goes to the
placer, each placement starts by the live start rule (`plan_starts`), the surplus choice stops the same
replicas, a rolling update retires the previous generation. What stays here is the data plane and time:
a CPU change re-forks the stage's replicas (its zygotes stay cached), new replicas are ready after the delay of their mechanism
(gpu / fork / cold; with ``start_mechanisms`` also peer / multicast / live / paraserve:
`quart_tools.sim.starting`), the ask → ready estimate is the same moving average. Requests are admitted
or refused (429) only at the pipeline's entry, as by the live router.

``whole_model=True`` serves the model as one function (INFless as the paper ran it): a request holds
one replica of every stage for the whole model's time, no pipelining (`quart_tools.sim.wholemodel`).

The event loop is a plain binary heap (heapq) rather than SimPy processes: the Fig. 7 sweep is 175
ten-minute runs of up to a million stage visits each, and a heap of tuples is several times faster.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
from gateway_plugin.config import PluginConfig
from gateway_plugin.controller import Change, Controller
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.snapshot_builder import StageState
from quart_kernel.convergence import Convergence, FunctionView, PlatformView, ReplicaView, converge
from quart_kernel.replicaset import note_key_scale, within_bounds
from quart_kernel.scheduling import ReplicaRequest, SchedulerConfig, make_placer
from quart_tools.arrivals import Arrivals
from quart_tools.report import StageSample
from quart_tools.sim.cluster import Host, make_hosts
from quart_tools.sim.starting import StartsMixin
from quart_tools.sim.state import Replica, SimConfig, SimResult, StageSpec, _Stage
from quart_tools.sim.wholemodel import WholeModelFlow

_COMPLETE, _READY, _CONTROL, _RECONCILE = 0, 1, 2, 3
__all__ = ["SimActuator", "SimConfig", "SimResult", "Simulation", "StageSpec"]


class SimActuator:
    """The controller's actuator on the simulated platform (for `Controller.step`; the run itself applies
    `Controller.decide`'s changes directly, on simulated time)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        self.sim.scale(function, replicas, key)

    async def set_cpus(self, function: str, cpus: float) -> None:
        self.sim.set_cpus(function, cpus)


class Simulation(StartsMixin, WholeModelFlow):
    """One run of one policy over one arrival schedule."""

    def __init__(self, cfg: SimConfig, policy, arrivals: Arrivals) -> None:
        self.cfg = cfg
        self.policy = policy
        self.arrivals = arrivals
        cal = cfg.calibration
        self.cal = cal
        self.hosts = make_hosts(cal.hosts, cal.gpus_per_host, cal.host_memory_bytes, cfg.keysmanager,
                                cal.eviction_threshold)
        self.host_by_name = {h.name: h for h in self.hosts}
        self.placer = make_placer(cfg.placer, SchedulerConfig())  # defaults, never the QUART_SCHED_* environment
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
        # A hop either holds the replica (added to each stage visit, measured as service time, as the live
        # router times its whole call) or is a constant added to the end-to-end latency.
        self.hop_in_service = cfg.hop_s if cfg.hop_holds_replica else 0.0
        self.hops_s = cfg.hop_s * len(cfg.stages)
        self.hops_after = 0.0 if cfg.hop_holds_replica else self.hops_s
        self.functions = [st.function for st in self.stages]
        self.stage_by_fn = {st.function: st for st in self.stages}
        self.collector = MetricsCollector(cfg.window_s)
        self.collector.stages.update({st.function: st.metrics for st in self.stages})
        self.max_replicas = cfg.max_replicas or max(1, 2 * cal.hosts * cal.gpus_per_host // len(cfg.stages))
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.next_replica = 0
        self.latency = np.full(n, np.nan)
        self.arrival = arrivals.times.astype(float)
        self.enter = [0.0] * n  # whole-model mode: when the request entered service
        self.samples: list[StageSample] = []
        self.starts_by_source: dict[str, int] = {"gpu": 0, "fork": 0, "cold": 0}
        self.ready_s_by_source: dict[str, list[float]] = {"gpu": [], "fork": [], "cold": []}
        self.rejected = 0
        self.key_counts: dict[int, int] = {}
        self.gpu_seconds = 0.0
        self.cpu_seconds = 0.0  # Σ CPUs × slot time: what CPU compensation spends beside the GPUs
        self.events = 0
        self.decisions: list[tuple[float, tuple[int, ...]]] = []
        self.key_history: dict[str, int] = {}  # the gateway's count of key-stage scale-ups per function
        self._reconcile_due = False
        self.launched: list[Replica] = []
        self._groups: dict = {}  # ParaServe groups of this run (quart_tools.sim.starting)
        self.paraserve_plans: list[tuple[int, float, bool]] = []
        if cfg.start_mechanisms and cfg.whole_model:
            raise ValueError("start_mechanisms: not with whole_model (a live or split start needs stages)")
        plugin = PluginConfig(queue_cap=cfg.queue_cap, window_s=cfg.window_s, control_period_s=cfg.control_period_s,
                              slo_factor=cfg.slo_factor)
        self.controller = Controller(self, self, self.collector, SimActuator(self), lambda: policy, plugin,
                                     slo_s={cfg.model: cfg.slo_s}, clock=lambda: self.now, keep_timeline=False)
        for st in self.stages:
            st.desired = cfg.initial_replicas
        self._place_initial()

    # ------------------------------------------------------------------------------ helpers
    def _push(self, t: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def _new_replica(self, stage: _Stage, host: Host, source: str, now: float) -> Replica:
        slot, resident = host.take_slot(stage.function, now)
        if resident:
            source = "gpu"
        rep = Replica(self.next_replica, stage.index, host, slot, source, now, stage.cpus, stage.generation)
        rep.factor = self.cal.cpu_factor(stage.cpus)
        self.next_replica += 1
        host.occupy(slot, rep, stage.function)
        return rep

    def _place_initial(self) -> None:
        """``initial_replicas`` per stage, placed by the placer, ready at t = 0 (as after a deploy)."""
        reqs = [ReplicaRequest(s.function, self.cfg.initial_replicas, s.spec.param_bytes) for s in self.stages]
        result = self.placer.place([h.view() for h in self.hosts], reqs, {})
        by_fn = {s.function: s for s in self.stages}
        for p in result.placements:
            stage, host = by_fn[p.function], self.host_by_name[p.host]
            host.cache_stage(stage.function, stage.spec.param_bytes, 0.0)
            rep = self._new_replica(stage, host, "gpu", 0.0)
            rep.state = "ready"
            stage.ready[rep] = None
            stage.free.append(rep)
        if result.unplaced:
            raise ValueError(f"the cluster cannot hold the initial replicas: {result.unplaced}")
        if self.cfg.keysmanager:  # deploy-time prefetch: caches as on a cluster that has served the model
            count = len(self.hosts) if self.cfg.prewarm_hosts < 0 else self.cfg.prewarm_hosts
            for host in self.hosts[:count]:
                for st in self.stages:
                    host.cache_stage(st.function, st.spec.param_bytes, 0.0)

    def _release(self, rep: Replica, now: float) -> None:
        rep.state = "gone"
        self.gpu_seconds += now - rep.requested_at
        self.cpu_seconds += (now - rep.requested_at) * rep.cpus
        rep.host.release_slot(rep.slot, self.stages[rep.stage].function, now, self.cfg.gpu_keep_s)

    # ------------------------------------------------------------------------- request flow
    def _admit(self) -> bool:
        """The live router's admission, at the pipeline's entry only: 429 when any stage's queue is full."""
        if any(len(st.queue) >= self.cfg.queue_cap for st in self.stages):
            self.rejected += 1  # the request ends here, latency stays NaN
            return False
        return True

    def _arrive(self, req: int, stage: _Stage, now: float) -> None:
        if stage.index == 0 and not self._admit():
            return
        stage.metrics.on_arrival(now, stage.spec.activation_bytes)
        stage.arrivals.append(now)
        if stage.free:
            self._start(req, stage, stage.free.pop(), now, now)
        elif stage.live_free:
            self._partial(req, stage, stage.live_free.pop(), now, now)
        else:
            stage.queue.append((req, now))

    def _start(self, req: int, stage: _Stage, rep: Replica, now: float, enqueued: float) -> None:
        stage.metrics.on_dispatch(now, now - enqueued)
        stage.busy += 1
        rep.in_flight += 1
        service = stage.spec.service_s * rep.factor * stage.draws[req] + self.hop_in_service
        self.seq += 1
        heapq.heappush(self.heap, (now + service, self.seq, _COMPLETE, (req, rep, service)))

    def _complete(self, req: int, rep: Replica, service: float, now: float) -> None:
        stage = self.stages[rep.stage]
        stage.metrics.on_complete(now, service)
        stage.busy -= 1
        rep.in_flight -= 1
        if rep.first_done < 0:
            rep.first_done = now
        if rep.state == "draining":
            self._release(rep, now)
        else:
            self._serve_next(stage, rep, now)
        self._advance(req, rep.stage, now)

    def _advance(self, req: int, index: int, now: float) -> None:
        """A request is done with stage ``index``: on to the next stage, or finished."""
        if index + 1 < len(self.stages):
            self._arrive(req, self.stages[index + 1], now)
        else:
            self.latency[req] = (now - self.arrival[req] + self.hops_after) * 1000.0

    # ------------------------------------------------------------------------- control loop
    # Inventory and QueueView (gateway_plugin.snapshot_builder) of the simulated platform and router.
    def pipelines(self) -> dict[str, list[str]]:
        return {self.cfg.model: list(self.functions)}

    def stage_state(self, function: str) -> StageState:
        st = self.stage_by_fn[function]
        return StageState(ready=len(st.ready), desired=st.desired, cpus=st.cpus,
                          min_replicas=self.cfg.min_replicas, max_replicas=self.max_replicas, concurrency=1,
                          param_bytes=st.spec.param_bytes,
                          profiled_service_s=st.spec.service_s if self.cfg.profile_label else 0.0,
                          start_s=st.start_time.seconds)

    def queue_len(self, function: str) -> int:
        st = self.stage_by_fn[function]
        return len(st.queue) + len(st.remainders)

    def busy(self, function: str) -> int:
        return self.stage_by_fn[function].busy

    def _control(self, now: float) -> None:
        """One step of the live controller; then the platform converges, as the gateway's kicked reconcile."""
        if self.cfg.record_series:
            for st in self.stages:
                self.samples.append(StageSample(now, st.index, len(st.ready) + len(st.starting), len(st.queue)))
        decisions, changes = self.controller.decide()
        self.apply(changes)
        decision = decisions[self.cfg.model]
        if decision.key_stages:
            self.decisions.append((now, tuple(sorted(decision.key_stages))))
            for i in decision.key_stages:
                self.key_counts[i] = self.key_counts.get(i, 0) + 1
        self._converge(now)

    def apply(self, changes: list[Change]) -> None:
        """The controller's changes, as the embedded gateway applies them (`EmbeddedGateway.scale`, `.update_limits`)."""
        for change in changes:
            if change.replicas is not None:
                self.scale(change.function, change.replicas, change.key)
            if change.cpus is not None:
                self.set_cpus(change.function, change.cpus)

    def scale(self, function: str, replicas: int, key: bool = False) -> None:
        st = self.stage_by_fn[function]
        applied = within_bounds(replicas, self.max_replicas)  # the registry's rule (com.openfaas.scale.max)
        note_key_scale(self.key_history, function, st.desired, applied, key)
        st.desired = applied

    def set_cpus(self, function: str, cpus: float) -> None:
        """A CPU change is a rolling update: a new generation starts; the hosts keep the stage's zygotes and
        resident parameters (only the replicas' cores and threads change; the live registry does the same)."""
        st = self.stage_by_fn[function]
        st.cpus = cpus
        st.generation += 1

    def view(self, now: float) -> PlatformView:
        """This platform as the one convergence reads it (the live reconciler's `Reconciler.view`)."""
        functions = []
        for st in self.stages:
            current = st.current()
            protected = frozenset(str(r.id) for r in current if r.group is not None and any(
                m.consolidated_at < 0 and m.state in ("starting", "ready") for m in r.group))
            functions.append(FunctionView(
                st.function, st.desired, st.generation,
                tuple(ReplicaView(str(r.id), r.state, r.generation, r.in_flight, r.started_at) for r in current),
                0, 0.0, protected, st.spec.param_bytes, st.function in self.key_history, len(st.ready)))
        return PlatformView(now, tuple(functions), tuple(h.view() for h in self.hosts), dict(self.key_history),
                            self.cfg.start_mechanisms)

    def _converge(self, now: float) -> Convergence:
        """The gateway's reconcile: the one convergence's actions, carried out on this platform."""
        plan = converge(self.view(now), self.placer, self._paraserve_parts)
        by_id = {str(r.id): r for st in self.stages for r in st.current()}
        for action in plan.actions:
            rep = by_id.get(action.replica) if action.replica else None
            if rep is not None:  # stop / drain / retire
                self._stop(self.stage_by_fn[action.function], rep, now)
        if plan.schedule is not None:
            self._scale_up(plan, now)
        return plan

    def _stop(self, st: _Stage, rep: Replica, now: float) -> None:
        """Drain and stop one replica: at once if it serves nothing, after its request otherwise."""
        if rep.state == "starting":
            st.starting.remove(rep)
            self._live_ready(st, rep)  # a live replica may be running its part of a request
        else:
            st.ready.pop(rep, None)
            if not rep.in_flight:
                st.free.remove(rep)
        if rep.in_flight:
            rep.state = "draining"
        else:
            self._release(rep, now)
        if rep.group is not None:
            self._group_stopped(st, rep, now)

    def _reconcile(self, now: float) -> None:
        """The gateway's periodic reconcile: place what is still missing once a GPU has come free."""
        self._reconcile_due = False
        if any(h.gpu_used < h.gpus for h in self.hosts):
            self._converge(now)
        elif any(len([r for r in st.current() if r.generation == st.generation]) < st.desired
                 for st in self.stages):
            self._reconcile_due = True
            self._push(now + self.cfg.reconcile_s, _RECONCILE, None)

    def _scale_up(self, plan: Convergence, now: float) -> None:
        result = plan.schedule
        assert result is not None
        for host in self.hosts:  # keep_cached is binding, as the live gateway pins it on each KeysManager
            host.pinned = frozenset(f for f, h in result.keep_cached if h == host.name)
        for action in plan.starts:
            start = action.plan
            assert start is not None
            host = self.host_by_name[start.host]
            if host.gpu_used >= host.gpus:
                continue  # defensive: a placer must not overfill a host
            self._launch(self.stage_by_fn[action.function], host, start.mode, now, start)
        if result.unplaced and not self._reconcile_due and self.cfg.reconcile_s > 0:
            self._reconcile_due = True
            self._push(now + self.cfg.reconcile_s, _RECONCILE, None)

    def _ready(self, rep: Replica, now: float) -> None:
        if rep.state != "starting":
            return  # cancelled while starting
        st = self.stages[rep.stage]
        if rep.helper:
            self._helper_ready(st, rep, now)
            return
        st.starting.remove(rep)
        self._live_ready(st, rep)
        rep.state = "ready"
        rep.ready_at = now
        if self.cfg.cache_on_ready and rep.source in ("cold", "peer", "multicast", "live"):
            rep.host.cache_stage(st.function, st.spec.param_bytes, now)
        took = now - rep.requested_at
        self.ready_s_by_source.setdefault(rep.source, []).append(took)
        st.start_time.note(took)
        st.ready[rep] = None
        if self.cfg.whole_model:
            st.free.append(rep)
            self._wm_dispatch(now)
        elif not rep.in_flight:  # a live replica still running its part of a request takes the next one then
            self._serve_next(st, rep, now)
        if any(r.generation != st.generation for r in st.ready):
            self._converge(now)  # a rolling update may retire the previous generation now

    def _serve_next(self, stage: _Stage, rep: Replica, now: float) -> None:
        """A replica is free: it takes the oldest remainder of a live replica's request, else the oldest waiting
        request of its stage, or goes idle."""
        if stage.remainders:
            self._start_remainder(stage, rep, now)
        elif stage.queue:
            req, enq = stage.queue.popleft()
            self._start(req, stage, rep, now, enq)
        else:
            stage.free.append(rep)

    # --------------------------------------------------------------------------------- run
    def run(self) -> SimResult:
        cfg = self.cfg
        times = self.arrival.tolist()
        n = len(times)
        horizon = (times[-1] if n else 0.0) + cfg.drain_s
        self._push(0.0, _CONTROL, None)
        heap = self.heap
        i = 0
        wm = cfg.whole_model
        stage0 = self.stages[0]
        events = 0
        while True:
            next_arrival = times[i] if i < n else math.inf
            if heap and heap[0][0] <= next_arrival:
                t, _, kind, payload = heapq.heappop(heap)
                if t > horizon:
                    break
                self.now = t
                events += 1
                if kind == _COMPLETE:
                    if wm:
                        self._wm_complete(payload[0], payload[1], payload[2], t)
                    else:
                        self._complete(payload[0], payload[1], payload[2], t)
                elif kind == _READY:
                    self._ready(payload, t)
                elif kind == _RECONCILE:
                    self._reconcile(t)
                elif kind > _RECONCILE:
                    self._start_event(kind, payload, t)
                else:
                    self._control(t)
                    if i < n or any(s.busy or s.queue for s in self.stages):
                        self._push(t + cfg.control_period_s, _CONTROL, None)
            elif i < n:
                self.now = next_arrival
                events += 1
                if wm:
                    self._wm_arrive(i, next_arrival)
                else:
                    self._arrive(i, stage0, next_arrival)
                i += 1
            else:
                break
        end = self.now
        for h in self.hosts:  # slots still held at the end (starting, ready or draining replicas)
            for slot in h.slots:
                if slot.replica is not None:
                    self.gpu_seconds += end - slot.replica.requested_at
                    self.cpu_seconds += (end - slot.replica.requested_at) * slot.replica.cpus
        return SimResult(
            model=cfg.model,
            policy=getattr(self.policy, "name", type(self.policy).__name__),
            latencies_ms=self.latency,
            arrival_s=self.arrival,
            duration_s=float(times[-1]) if n else 0.0,
            end_s=end,
            samples=self.samples,
            stage_arrivals={st.index: st.arrivals for st in self.stages},
            starts_by_source=self.starts_by_source,
            ready_s_by_source=self.ready_s_by_source,
            rejected=self.rejected,
            key_stage_counts=self.key_counts,
            gpu_seconds=self.gpu_seconds,
            cpu_seconds=self.cpu_seconds,
            evictions=sum(h.evictions for h in self.hosts),
            events=events,
            decisions=self.decisions,
            launched=self.launched,
            paraserve_plans=self.paraserve_plans,
        )
