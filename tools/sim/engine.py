"""The discrete-event engine: gateway queues, stage replicas, the control loop, on simulated time.

One request walks the pipeline's stages; each stage has one FIFO queue (the router's) and dispatches
to a free replica slot. Service times are the stage's profiled time × the CPU effect × a gamma draw;
the draws are per (request, stage), so every policy sees the same request sizes (common random
numbers). Every ``control_period_s`` the live `gateway_plugin.controller.Controller` takes a step over
this simulated platform (it is the controller's Inventory, QueueView and, through `SimActuator`, its
Actuator): the same snapshot builder over the live sliding-window metrics, the same policy, the same
bounds. What follows a decision is the live provider's rules (`quart_provider.replicaset`): the
shortfall goes to the placer (`quart_provider.scheduling`), the surplus choice stops the same replicas,
a CPU change is a rolling update that drops the stage's cached zygotes, the ask → ready estimate is the
same moving average. New replicas are ready after the delay of their source (gpu / fork / cold).
Requests are admitted or refused (429) only at the pipeline's entry, as by the live router.

``whole_model=True`` serves the model as one function (INFless as the paper ran it): a request holds
one replica of every stage for the whole model's time, no pipelining.

The event loop is a plain binary heap (heapq) rather than SimPy processes: the Fig. 7 sweep is 175
ten-minute runs of up to a million stage visits each, and a heap of tuples is several times faster.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from gateway_plugin.config import PluginConfig
from gateway_plugin.controller import Controller
from gateway_plugin.metrics import MetricsCollector, StageMetrics
from gateway_plugin.snapshot_builder import StageState
from quart_provider.replicaset import (
    StartTimeEstimate,
    choose_surplus,
    note_key_scale,
    rollover_done,
    shortfall,
)
from quart_provider.scheduling import ReplicaRequest, SchedulerConfig, make_placer
from quart_tools.arrivals import Arrivals
from quart_tools.report import StageSample
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.cluster import Host, Slot, make_hosts

_COMPLETE, _READY, _CONTROL, _RECONCILE = 0, 1, 2, 3
_LIVE = PluginConfig()  # the live defaults the simulator starts from


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage as the simulator needs it."""

    name: str
    service_s: float  # mean service time at cpu_ref CPUs
    param_bytes: int
    activation_bytes: float = 0.0


@dataclass(frozen=True)
class SimConfig:
    """One simulated run."""

    model: str
    stages: tuple[StageSpec, ...]
    slo_s: float  # the SLO the policy aims at (snapshot.slo_s); 0 = slo_factor × Σ stage times, as live
    calibration: Calibration = field(default_factory=Calibration)
    keysmanager: bool = True  # hosts cache parameters and fork; False: every start is cold
    placer: str = "cache-aware"  # or "first-fit"
    whole_model: bool = False  # serve the model as one function (INFless)
    initial_replicas: int = 1  # per stage, ready (on GPU) at t = 0
    prewarm_hosts: int = -1  # hosts whose KeysManager holds every stage at t = 0 (−1 = all; KM only)
    min_replicas: int = 1
    max_replicas: int = 0  # per stage (com.openfaas.scale.max); 0 = 2 × GPU slots / stages
    control_period_s: float = _LIVE.control_period_s
    reconcile_s: float = 0.2  # replicas asked for but not placed (full cluster) are retried this often, as the
    # embedded gateway's reconcile loop (reconcile_interval_s) does; the policy sees them as pending meanwhile
    window_s: float = _LIVE.window_s
    queue_cap: int = _LIVE.queue_cap  # waiting requests per stage before the router answers 429
    hop_s: float = 0.001  # router hop per stage (gateway → replica → gateway)
    hop_holds_replica: bool = True  # the hop is part of the replica's busy time (the live router's call)
    slo_factor: float = _LIVE.slo_factor  # with slo_s = 0: SLO = slo_factor × Σ profiled stage times
    profile_label: bool = True  # stages carry their profiled time (com.quart.profile-ms); False: measured
    gpu_keep_s: float = 0.0  # a released replica's parameters stay on its GPU this long
    cpus: float = 1.0  # initial CPUs per replica
    drain_s: float = 120.0  # after the last arrival, keep simulating this long for stragglers
    seed: int = 0
    record_series: bool = True


class Replica:
    __slots__ = ("id", "stage", "host", "slot", "state", "cpus", "source", "requested_at", "factor", "in_flight",
                 "generation")

    def __init__(self, rid: int, stage: int, host: Host, slot: Slot, source: str, now: float, cpus: float,
                 generation: int = 1):
        self.id, self.stage, self.host, self.slot = rid, stage, host, slot
        self.state = "starting"  # starting | ready | draining | gone
        self.cpus, self.source, self.requested_at = cpus, source, now
        self.factor = 1.0  # service-time multiplier of its CPUs (Calibration.cpu_factor)
        self.in_flight = 0
        self.generation = generation  # the stage's spec generation it runs (a CPU change starts a new one)

    @property
    def started_at(self) -> float:  # quart_provider.replicaset.ReplicaLike
        return self.requested_at


class SimActuator:
    """The controller's actuator on the simulated platform: the embedded gateway's scale / update_limits."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        self.sim.scale(function, replicas, key)

    async def set_cpus(self, function: str, cpus: float) -> None:
        self.sim.set_cpus(function, cpus)


def drive(coro):
    """Run a coroutine that never suspends (the simulated actuator answers at once); returns its result."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a simulated control step suspended: the simulated platform must answer at once")


class _Stage:
    __slots__ = ("index", "spec", "queue", "free", "ready", "starting", "busy", "metrics", "draws", "cpus",
                 "arrivals", "function", "start_time", "desired", "generation")

    def __init__(self, index: int, spec: StageSpec, window_s: float, draws: list[float], cpus: float):
        self.index, self.spec, self.function = index, spec, spec.name
        self.queue: deque = deque()  # (request, enqueue time)
        self.free: list[Replica] = []  # ready, idle
        self.ready: dict[Replica, None] = {}  # ready, not draining; insertion-ordered for determinism
        self.starting: list[Replica] = []
        self.busy = 0
        self.metrics = StageMetrics(window_s, trim_on_event=False)  # the live class; reads trim
        self.draws = draws
        self.cpus = cpus
        self.arrivals: list[float] = []
        self.start_time = StartTimeEstimate()  # ask → ready of recent replicas, as the live gateway measures it
        self.desired = 0  # the last count asked for (the gateway's FunctionState.desired), placed or not
        self.generation = 1

    def current(self) -> list[Replica]:
        """Starting and ready replicas (not draining) of every generation."""
        return [*self.ready, *self.starting]


@dataclass
class SimResult:
    """What one run produced: per-request latencies and the time series the report needs."""

    model: str
    policy: str
    latencies_ms: np.ndarray  # NaN = rejected / unfinished
    arrival_s: np.ndarray
    duration_s: float  # the arrival schedule's span
    end_s: float  # simulated time at the end
    samples: list[StageSample]
    stage_arrivals: dict[int, list[float]]
    starts_by_source: dict[str, int]
    ready_s_by_source: dict[str, list[float]]
    rejected: int
    key_stage_counts: dict[int, int]
    gpu_seconds: float  # Σ over replicas of (release or end − request time): slots held
    evictions: int
    events: int
    decisions: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)


class Simulation:
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
        self.events = 0
        self.decisions: list[tuple[float, tuple[int, ...]]] = []
        self.key_history: dict[str, int] = {}  # the gateway's count of key-stage scale-ups per function
        self._reconcile_due = False
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
        if rep.state == "draining":
            self._release(rep, now)
        else:
            self._serve_next(stage, rep, now)
        nxt_index = rep.stage + 1
        if nxt_index < len(self.stages):
            self._arrive(req, self.stages[nxt_index], now)
        else:
            self.latency[req] = (now - self.arrival[req] + self.hops_after) * 1000.0

    # ------------------------------------------------------- whole-model (non-pipelined) flow
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

    def _wm_complete(self, req: int, reps: list[Replica], started: float, now: float) -> None:
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
        return len(self.stage_by_fn[function].queue)

    def busy(self, function: str) -> int:
        return self.stage_by_fn[function].busy

    def _control(self, now: float) -> None:
        """One step of the live controller; then the platform converges, as the gateway's kicked reconcile."""
        if self.cfg.record_series:
            for st in self.stages:
                self.samples.append(StageSample(now, st.index, len(st.ready) + len(st.starting), len(st.queue)))
        decision = drive(self.controller.step())[self.cfg.model]
        if self.controller.errors:
            raise RuntimeError(f"the simulated actuator failed {self.controller.errors} time(s); see the log")
        if decision.key_stages:
            self.decisions.append((now, tuple(sorted(decision.key_stages))))
            for i in decision.key_stages:
                self.key_counts[i] = self.key_counts.get(i, 0) + 1
        self._converge(now)

    # The embedded gateway's scale / update_limits (EmbeddedGateway.scale, .update_limits), on simulated time.
    def scale(self, function: str, replicas: int, key: bool = False) -> None:
        st = self.stage_by_fn[function]
        applied = min(replicas, self.max_replicas)  # the gateway clamps to com.openfaas.scale.max
        note_key_scale(self.key_history, function, st.desired, applied, key)
        st.desired = applied

    def set_cpus(self, function: str, cpus: float) -> None:
        """A CPU change is a rolling update: a new generation starts, the hosts drop the stage's zygotes."""
        st = self.stage_by_fn[function]
        st.cpus = cpus
        st.generation += 1
        for host in self.hosts:
            host.invalidate(function)

    def _converge(self, now: float) -> None:
        """The gateway's reconcile (quart_provider.replicaset): ask the placer for the shortfall, stop the
        surplus, retire a previous generation once the new one is ready."""
        requests = []
        for st in self.stages:
            current = [r for r in st.current() if r.generation == st.generation]
            missing = shortfall(st.desired, len(current))
            if missing:
                requests.append(ReplicaRequest(st.function, missing, st.spec.param_bytes,
                                               st.function in self.key_history))
            for rep in choose_surplus(current, st.desired):
                self._stop(st, rep, now)
            old = [r for r in st.current() if r.generation != st.generation]
            if old and rollover_done(sum(1 for r in current if r.state == "ready"), st.desired):
                for rep in old:
                    self._stop(st, rep, now)
        if requests:
            self._scale_up(requests, now)

    def _stop(self, st: _Stage, rep: Replica, now: float) -> None:
        """Drain and stop one replica: at once if it serves nothing, after its request otherwise."""
        if rep.state == "starting":
            st.starting.remove(rep)
        else:
            st.ready.pop(rep, None)
            if rep.in_flight:
                rep.state = "draining"
                return
            st.free.remove(rep)
        self._release(rep, now)

    def _reconcile(self, now: float) -> None:
        """The gateway's periodic reconcile: place what is still missing once a GPU has come free."""
        self._reconcile_due = False
        if any(h.gpu_used < h.gpus for h in self.hosts):
            self._converge(now)
        elif any(len([r for r in st.current() if r.generation == st.generation]) < st.desired
                 for st in self.stages):
            self._reconcile_due = True
            self._push(now + self.cfg.reconcile_s, _RECONCILE, None)

    def _scale_up(self, requests: list[ReplicaRequest], now: float) -> None:
        result = self.placer.place([h.view() for h in self.hosts], requests, dict(self.key_history))
        for host in self.hosts:  # keep_cached is binding, as the live gateway pins it on each KeysManager
            host.pinned = frozenset(f for f, h in result.keep_cached if h == host.name)
        by_fn = {s.function: s for s in self.stages}
        for p in result.placements:
            stage, host = by_fn[p.function], self.host_by_name[p.host]
            if host.gpu_used >= host.gpus:
                continue  # defensive: a placer must not overfill a host
            source = "fork" if host.is_cached(stage.function) else "cold"
            rep = self._new_replica(stage, host, source, now)
            if rep.source == "cold":
                host.cache_stage(stage.function, stage.spec.param_bytes, now)
            else:
                host.touch(stage.function, now)
            delay = self.cal.ready_s(rep.source, stage.spec.param_bytes)
            self.starts_by_source[rep.source] += 1
            stage.starting.append(rep)
            self._push(now + delay, _READY, rep)
        if result.unplaced and not self._reconcile_due and self.cfg.reconcile_s > 0:
            self._reconcile_due = True
            self._push(now + self.cfg.reconcile_s, _RECONCILE, None)

    def _ready(self, rep: Replica, now: float) -> None:
        if rep.state != "starting":
            return  # cancelled while starting
        st = self.stages[rep.stage]
        st.starting.remove(rep)
        rep.state = "ready"
        took = now - rep.requested_at
        self.ready_s_by_source[rep.source].append(took)
        st.start_time.note(took)
        st.ready[rep] = None
        if self.cfg.whole_model:
            st.free.append(rep)
            self._wm_dispatch(now)
        else:
            self._serve_next(st, rep, now)
        if any(r.generation != st.generation for r in st.ready):
            self._converge(now)  # a rolling update may retire the previous generation now

    def _serve_next(self, stage: _Stage, rep: Replica, now: float) -> None:
        """A replica is free: it takes the oldest waiting request of its stage, or goes idle."""
        if stage.queue:
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
            evictions=sum(h.evictions for h in self.hosts),
            events=events,
            decisions=self.decisions,
        )
