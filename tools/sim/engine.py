"""The discrete-event engine: gateway queues, stage replicas, the control loop, on simulated time.

One request walks the pipeline's stages; each stage has one FIFO queue (the router's) and dispatches
to a free replica slot. Service times are the stage's profiled time × the CPU effect × a gamma draw;
the draws are per (request, stage), so every policy sees the same request sizes (common random
numbers). Every ``control_period_s`` the controller builds a `PipelineSnapshot` with the live
`gateway_plugin.snapshot_builder.build_snapshot` over the live sliding-window stage metrics
(`gateway_plugin.metrics.StageMetrics`, running sums), calls the policy
(`gateway_plugin.policies.make_policy`), asks the placer (`quart_provider.scheduling.make_placer`)
where new replicas go, and starts them after the delay of their source (gpu / fork / cold).

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
from gateway_plugin.metrics import MetricsCollector, StageMetrics
from gateway_plugin.snapshot import PipelineSnapshot
from gateway_plugin.snapshot_builder import StageState, build_snapshot
from quart_provider.scheduling import ReplicaRequest, make_placer
from quart_tools.arrivals import Arrivals
from quart_tools.report import StageSample
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.cluster import Host, Slot, make_hosts

_COMPLETE, _READY, _CONTROL, _RECONCILE = 0, 1, 2, 3
START_TIME_ALPHA = 0.3  # weight of the newest ask → ready sample (gateway FunctionState.note_start_time)


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
    control_period_s: float = 1.0
    reconcile_s: float = 0.2  # replicas asked for but not placed (full cluster) are retried this often, as the
    # embedded gateway's reconcile loop (reconcile_interval_s) does; the policy sees them as pending meanwhile
    window_s: float = 10.0
    queue_cap: int = 1024  # waiting requests per stage before the gateway answers 429
    hop_s: float = 0.001  # router hop per stage (gateway → replica → gateway)
    hop_holds_replica: bool = True  # the hop is part of the replica's busy time (the live router's call)
    slo_factor: float = 2.0  # with slo_s = 0: the live PluginConfig.slo_factor rule
    profile_label: bool = True  # stages carry their profiled time (com.quart.profile-ms); False: measured
    gpu_keep_s: float = 0.0  # a released replica's parameters stay on its GPU this long
    cpus: float = 1.0  # initial CPUs per replica
    drain_s: float = 120.0  # after the last arrival, keep simulating this long for stragglers
    seed: int = 0
    record_series: bool = True


class Replica:
    __slots__ = ("id", "stage", "host", "slot", "state", "cpus", "source", "requested_at", "factor")

    def __init__(self, rid: int, stage: int, host: Host, slot: Slot, source: str, now: float, cpus: float):
        self.id, self.stage, self.host, self.slot = rid, stage, host, slot
        self.state = "starting"  # starting | ready | draining | gone
        self.cpus, self.source, self.requested_at = cpus, source, now
        self.factor = 1.0  # service-time multiplier of its CPUs (Calibration.cpu_factor)


class _Stage:
    __slots__ = ("index", "spec", "queue", "free", "ready", "starting", "busy", "metrics", "draws", "cpus",
                 "arrivals", "function", "start_s", "desired")

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
        self.start_s = -1.0  # ask → ready of recent replicas (EMA), as the live gateway measures it
        self.desired = 0  # the last count asked for (the gateway's FunctionState.desired), placed or not


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
        self.placer = make_placer(cfg.placer)
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
        self._reconcile_due = False
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
        rep = Replica(self.next_replica, stage.index, host, slot, source, now, stage.cpus)
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
    def _arrive(self, req: int, stage: _Stage, now: float) -> None:
        stage.metrics.on_arrival(now, stage.spec.activation_bytes)
        stage.arrivals.append(now)
        if stage.free:
            self._start(req, stage, stage.free.pop(), now, now)
        elif len(stage.queue) >= self.cfg.queue_cap:
            self.rejected += 1  # 429: the request ends here, latency stays NaN
        else:
            stage.queue.append((req, now))

    def _start(self, req: int, stage: _Stage, rep: Replica, now: float, enqueued: float) -> None:
        stage.metrics.on_dispatch(now, now - enqueued)
        stage.busy += 1
        service = stage.spec.service_s * rep.factor * stage.draws[req] + self.hop_in_service
        self.seq += 1
        heapq.heappush(self.heap, (now + service, self.seq, _COMPLETE, (req, rep, service)))

    def _complete(self, req: int, rep: Replica, service: float, now: float) -> None:
        stage = self.stages[rep.stage]
        stage.metrics.on_complete(now, service)
        stage.busy -= 1
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
        for st in self.stages:
            st.metrics.on_arrival(now, st.spec.activation_bytes)
        self.stages[0].arrivals.append(now)
        q = self.stages[0].queue
        if not q and all(st.free for st in self.stages):
            self._wm_start(req, now, now)
        elif len(q) >= self.cfg.queue_cap:
            self.rejected += 1
        else:
            q.append((req, now))

    def _wm_start(self, req: int, now: float, enqueued: float) -> None:
        reps, total = [], 0.0
        for st in self.stages:
            rep = st.free.pop()
            st.busy += 1
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
    def _snapshot(self, now: float) -> PipelineSnapshot:
        """The live controller's snapshot builder over the simulated router, platform and windows."""
        return build_snapshot(now, self.cfg.model, self.functions, self, self, self.collector,
                              slo_factor=self.cfg.slo_factor, slo_s={self.cfg.model: self.cfg.slo_s})

    # Inventory and QueueView (gateway_plugin.snapshot_builder) of the simulated platform and router.
    def pipelines(self) -> dict[str, list[str]]:
        return {self.cfg.model: list(self.functions)}

    def stage_state(self, function: str) -> StageState:
        st = self.stage_by_fn[function]
        ready = len(st.ready)
        return StageState(ready=ready, desired=max(st.desired, ready + len(st.starting)), cpus=st.cpus,
                          min_replicas=self.cfg.min_replicas, max_replicas=self.max_replicas, concurrency=1,
                          param_bytes=st.spec.param_bytes,
                          profiled_service_s=st.spec.service_s if self.cfg.profile_label else 0.0,
                          start_s=st.start_s)

    def queue_len(self, function: str) -> int:
        return len(self.stage_by_fn[function].queue)

    def busy(self, function: str) -> int:
        return self.stage_by_fn[function].busy

    def _key_history(self) -> dict[str, int]:
        hist = getattr(self.policy, "key_history", None) or {}
        return {self.stages[i].function: int(n) for i, n in hist.items() if 0 <= i < len(self.stages)}

    def _control(self, now: float) -> None:
        if self.cfg.record_series:
            for st in self.stages:
                self.samples.append(StageSample(now, st.index, len(st.ready) + len(st.starting), len(st.queue)))
        decision = self.policy.decide(self._snapshot(now))
        key = set(decision.key_stages)
        if key:
            self.decisions.append((now, tuple(sorted(key))))
            for i in key:
                self.key_counts[i] = self.key_counts.get(i, 0) + 1
        requests = []
        for st, d in zip(self.stages, decision.stages, strict=True):
            if d.cpus > 0 and d.cpus != st.cpus:
                st.cpus = d.cpus
                factor = self.cal.cpu_factor(d.cpus)
                for rep in [*st.ready, *st.starting]:
                    rep.cpus, rep.factor = d.cpus, factor
            want = max(0, min(self.max_replicas, d.replicas))
            st.desired = want
            have = len(st.ready) + len(st.starting)
            if want > have:
                requests.append(ReplicaRequest(st.function, want - have, st.spec.param_bytes, st.index in key))
            elif want < have:
                self._scale_down(st, have - want, now)
        if requests:
            self._scale_up(requests, now)

    def _missing(self) -> list[ReplicaRequest]:
        """Replicas asked for and not placed yet (the gateway's ``unplaced``), as placer requests."""
        hist = getattr(self.policy, "key_history", None) or {}
        return [ReplicaRequest(st.function, st.desired - have, st.spec.param_bytes, st.index in hist)
                for st in self.stages if (have := len(st.ready) + len(st.starting)) < st.desired]

    def _reconcile(self, now: float) -> None:
        """The gateway's reconcile pass: place what is still missing when a GPU has come free."""
        self._reconcile_due = False
        missing = self._missing()
        if missing and any(h.gpu_used < h.gpus for h in self.hosts):
            self._scale_up(missing, now)
            missing = self._missing()
        if missing:
            self._reconcile_due = True
            self._push(now + self.cfg.reconcile_s, _RECONCILE, None)

    def _scale_up(self, requests: list[ReplicaRequest], now: float) -> None:
        result = self.placer.place([h.view() for h in self.hosts], requests, self._key_history())
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

    def _scale_down(self, st: _Stage, count: int, now: float) -> None:
        while count > 0 and st.starting:  # cancel the newest start first
            rep = st.starting.pop()
            self._release(rep, now)
            count -= 1
        while count > 0 and st.free:  # then idle replicas
            rep = st.free.pop()
            st.ready.pop(rep, None)
            self._release(rep, now)
            count -= 1
        if count > 0:  # then busy ones: they finish their request, then leave
            for rep in list(st.ready):
                if count == 0:
                    break
                rep.state = "draining"
                st.ready.pop(rep, None)
                count -= 1

    def _ready(self, rep: Replica, now: float) -> None:
        if rep.state != "starting":
            return  # cancelled while starting
        st = self.stages[rep.stage]
        st.starting.remove(rep)
        rep.state = "ready"
        took = now - rep.requested_at
        self.ready_s_by_source[rep.source].append(took)
        # The live gateway's FunctionState.note_start_time: EMA with weight START_TIME_ALPHA.
        st.start_s = took if st.start_s < 0 else (1 - START_TIME_ALPHA) * st.start_s + START_TIME_ALPHA * took
        st.ready[rep] = None
        if self.cfg.whole_model:
            st.free.append(rep)
            self._wm_dispatch(now)
        else:
            self._serve_next(st, rep, now)

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
