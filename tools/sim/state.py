"""The simulator's records: a stage's spec, a run's config, replicas, a stage's router state, a run's result.

Shared by the engine and its collaborators (`events`, `dataplane`, `wholemodel`, `starting`, `control`);
re-exported by the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from gateway_plugin.config import PluginConfig
from gateway_plugin.metrics import StageMetrics
from quart_kernel.replicaset import StartTimeEstimate
from quart_tools.report import StageSample
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.cluster import Host, Slot

_LIVE = PluginConfig()  # the live defaults the simulator starts from


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage as the simulator needs it."""

    name: str
    service_s: float  # mean service time at cpu_ref CPUs
    param_bytes: int
    activation_bytes: float = 0.0
    # generation (SimConfig.generation): a step's time is max(decode_s, positions × prefill_s_per_token)
    decode_s: float = 0.0
    prefill_s_per_token: float = 0.0
    kv_tokens: int = 0  # KV positions one replica of the stage holds
    kv_bytes_per_token: float = 0.0  # the stage's K and V of one position


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
    kick: bool = _LIVE.kick  # traffic kicks a decision between periods, as live (gateway_plugin.kick; its settings live's)
    reconcile_s: float = 0.2  # replicas asked for but not placed (full cluster) are retried this often, as the
    # embedded gateway's reconcile loop (reconcile_interval_s) does; the policy sees them as pending meanwhile
    window_s: float = _LIVE.window_s
    queue_cap: int = _LIVE.queue_cap  # waiting requests per stage before the router answers 429
    hop_s: float = 0.001  # router hop per stage (gateway → replica → gateway)
    hop_holds_replica: bool = True  # the hop is part of the replica's busy time (the live router's call)
    hop_per_call_s: float = 0.0  # a stage call's hold grows by this per stage call in flight when it starts, itself
    # included (the live host's CPU shared by the calls' HTTP and serialisation work; measured live)
    outside_s: float = 0.0  # per request, outside every replica: the router between stages, the front (measured live)
    dispatch_s: float = 0.0  # a replica that frees with requests waiting starts the next one this much later: the
    # router's dispatch (wake its stage's dispatcher, launch the call; measured live), the replica held meanwhile
    slo_factor: float = _LIVE.slo_factor  # with slo_s = 0: SLO = slo_factor × Σ profiled stage times
    profile_label: bool = True  # stages carry their profiled time (com.quart.profile-ms); False: measured
    gpu_keep_s: float = 0.0  # a released replica's parameters stay on its GPU this long
    cpus: float = 1.0  # initial CPUs per replica
    drain_s: float = 120.0  # after the last arrival, keep simulating this long for stragglers
    seed: int = 0
    record_series: bool = True
    # Scale-up sources beyond fork / cold (quart_kernel.scheduling.starts.MECHANISMS): "peer", "multicast",
    # "live", "paraserve". Empty: the fork-or-cold rule of the QUART paper's runs.
    start_mechanisms: frozenset[str] = frozenset()
    paraserve_slo_s: float = 0.0  # the first-response deadline ParaServe's P is chosen for; 0 = slo_s
    paraserve_max_parts: int = 8
    cache_on_ready: bool = False  # a new replica's host caches the stage once loaded (False: at its start)
    batch_max: int = 1  # requests one call of a replica carries at most (com.quart.batch.max); 1: no batching
    batch_fixed: float = 0.0  # F / S(1) of the batch profile S(b) = S(1)·(f + (1 − f)·b) (quart_tools.sim.batching)
    # Token generation (quart_tools.sim.generation): each arrival is a session, its prompt and output lengths
    # from the arrivals' tokens / generated (the trace's ContextTokens / GeneratedTokens), capped as
    # `quartctl load --generate` caps them.
    generation: bool = False
    max_context: int = 2048
    max_new_tokens: int = 256
    decode_batch: int = 64  # decode steps a replica runs as one batch (continuous batching); 1 = one at a time
    prefill_chunk: int = 128  # prompt positions per prefill step (chunked prefill); 0 = the whole prompt at once
    tpot_slo_s: float = 0.0  # the controller's TPOT target for the sessions' floor (QUART_TPOT_SLO_MS); 0 = KV room only


class Replica:
    __slots__ = ("id", "stage", "host", "slot", "state", "cpus", "source", "requested_at", "factor", "in_flight",
                 "generation", "live", "layer0", "layer_dt", "layers", "first_done", "ready_at", "consolidated_at",
                 "helper", "group", "cpu_extra_s")

    def __init__(self, rid: int, stage: int, host: Host, slot: Slot, source: str, now: float, cpus: float,
                 generation: int = 1):
        self.id, self.stage, self.host, self.slot = rid, stage, host, slot
        self.state = "starting"  # starting | ready | draining | gone
        self.cpus, self.source, self.requested_at = cpus, source, now
        self.factor = 1.0  # service-time multiplier of its CPUs (Calibration.cpu_factor)
        self.in_flight = 0
        self.generation = generation  # the stage's spec generation it runs (a CPU change starts a new one)
        self.live = False  # serves the layers it holds while loading (a live start, quart_tools.sim.dataplane)
        self.layer0, self.layer_dt, self.layers = 0.0, 1.0, 1  # live: first layer in, between layers, layers
        self.first_done = self.ready_at = self.consolidated_at = -1.0  # first work done, full load, consolidated
        self.helper = False  # a ParaServe helper: serves its part until its group consolidates, not a replica
        self.group: list | None = None  # ParaServe: every replica and helper of its sub-pipeline
        self.cpu_extra_s = 0.0  # CPU-seconds beyond (end − start) × cpus, from in-place resizes

    @property
    def started_at(self) -> float:  # quart_kernel.replicaset.ReplicaLike
        return self.requested_at


class _Stage:
    __slots__ = ("index", "spec", "queue", "free", "ready", "starting", "busy", "metrics", "draws", "cpus",
                 "arrivals", "function", "start_time", "desired", "generation", "live_free", "remainders", "waiting")

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
        self.live_free: list[Replica] = []  # live replicas (still loading) that wait for a request
        self.remainders: deque = deque()  # (request, seconds, part done): the rest of a live replica's request
        self.waiting = 0  # generation: steps waiting at this stage's replicas (quart_tools.sim.generation)

    def current(self) -> list[Replica]:
        """Starting and ready replicas (not draining) of every generation."""
        return [*self.ready, *self.starting]


class Tally:
    """What a run counts as it goes, written by the collaborators: each request's latency, refusals, slot time,
    starts and their ready times, key stages, the replicas launched."""

    def __init__(self, arrival_s: np.ndarray) -> None:
        self.arrival = arrival_s
        self.latency = np.full(len(arrival_s), np.nan)  # ms; NaN = refused or unfinished
        self.rejected = 0
        self.gpu_seconds = 0.0
        self.cpu_seconds = 0.0  # Σ CPUs × slot time: what CPU compensation spends beside the GPUs
        self.samples: list[StageSample] = []
        self.starts_by_source: dict[str, int] = {"gpu": 0, "fork": 0, "cold": 0}
        self.ready_s_by_source: dict[str, list[float]] = {"gpu": [], "fork": [], "cold": []}
        self.key_counts: dict[int, int] = {}
        self.decisions: list[tuple[float, tuple[int, ...]]] = []
        self.launched: list[Replica] = []  # replicas started after t = 0
        self.paraserve_plans: list[tuple[int, float, bool]] = []  # (P, predicted s, meets SLO)
        self.ttft_ms: np.ndarray | None = None  # generation: per session
        self.tpot_ms: np.ndarray | None = None
        self.token_gaps: list[tuple[float, float]] | None = None  # generation: (time, ms since the previous token)
        self.kv_migrations = 0  # generation: sessions whose KV moved to another replica (ParaServe consolidation)


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
    launched: list = field(default_factory=list)  # replicas started after t = 0 (Replica: times, source)
    paraserve_plans: list[tuple[int, float, bool]] = field(default_factory=list)  # (P, predicted s, meets SLO)
    cpu_seconds: float = 0.0  # Σ over replicas of CPUs × (release or end − request time)
    ttft_ms: np.ndarray | None = None  # generation: per session (NaN = refused or unfinished)
    tpot_ms: np.ndarray | None = None  # generation: per session (NaN also for one-token sessions)
    token_gaps: np.ndarray | None = None  # generation: [k, 2] (time s, ms since the session's previous token)
    kv_migrations: int = 0  # generation: sessions moved with their KV cache, never re-prefilled
    kicks: int = 0  # decisions traffic kicked between periods (gateway_plugin.kick)
