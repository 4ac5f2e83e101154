"""What a scaling policy sees and what it answers: the contract shared by the live plugin and the simulator.

A policy is a plain object with a ``name`` and ``decide(snapshot) -> Decision``. It may keep its own
state between calls (PID integrators, cooldown timers, forecasts) but never does I/O and never reads
the wall clock: time comes from ``PipelineSnapshot.time``, so the simulator can run the very same
policy code against simulated time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from quart_stage.labels import DEFAULT_MAX_REPLICAS, DEFAULT_MIN_REPLICAS


@dataclass(frozen=True, slots=True)
class StageSnapshot:
    """Metrics of one pipeline stage over the collector's sliding window."""

    name: str  # function name, e.g. "bert-21b-stage-3"
    index: int  # position in the pipeline, 0-based
    arrival_rate: float  # λ_i, requests/s entering this stage's queue
    service_rate: float  # μ_i, requests/s of ONE replica (1 / mean service time); 0.0 when unknown
    replicas: int  # r_i, ready replicas
    pending_replicas: int = 0  # replicas asked for but not ready yet
    busy: int = 0  # requests in service now
    queue_len: int = 0  # q_i, requests waiting now
    mean_wait_s: float = 0.0  # W_i, observed queueing delay over the window
    cv_arrival: float = 1.0  # CV_i of inter-arrival times over the window
    utilisation: float = 0.0  # busy time / (replicas × window)
    cpus: float = 1.0  # c_i, CPUs per replica
    min_replicas: int = DEFAULT_MIN_REPLICAS  # r_min (com.openfaas.scale.min)
    max_replicas: int = DEFAULT_MAX_REPLICAS  # r_max (com.openfaas.scale.max)
    target_s: float = 0.0  # per-stage delay target derived from the SLO
    param_bytes: int = 0  # parameters held by one replica
    activation_bytes: float = 0.0  # mean bytes of one request's input activations
    concurrency: int = 1  # requests one replica serves at once
    arrival_rate_recent: float = -1.0  # λ over the last second (−1: unknown → use arrival_rate)
    replica_start_s: float = -1.0  # measured ask → ready time of a new replica (−1: unknown → the policy learns it)
    sessions: int = 0  # generation sessions placed on this stage now (each holds a KV cache on one replica)
    kv_tokens: int = 0  # KV-cache positions those sessions booked (prompt + max_tokens each)
    kv_capacity: int = 0  # positions its ready replicas hold at most (0: not a generating stage)
    # (requests per call, calls, mean service s) by batch size, measured by the router (gateway_plugin.batching);
    # a profiled size not measured yet has calls 0. The capacity model: gateway_plugin.policies.batch_capacity
    batch_service_s: tuple[tuple[int, int, float], ...] = ()
    batch_max: int = 1  # requests the router sends one replica in one call (com.quart.batch.max; 1 = no batching)
    # (sessions per step, steps, mean service s) of its decode steps by batch size, measured by the session engine
    # (gateway_plugin.generation); the sessions' floor: gateway_plugin.policies.decode_capacity
    decode_service_s: tuple[tuple[int, int, float], ...] = ()
    decode_batch_max: int = 1  # sessions per batched decode step (com.quart.batch.decode-max; 1 = no batching)
    cpu_bound: bool = False  # its replicas compute on this machine's cores (QUART_COMPUTE=cpu): they share compute_cores

    @property
    def mean_service_s(self) -> float:
        return 1.0 / self.service_rate if self.service_rate > 0 else 0.0

    @property
    def recent_rate(self) -> float:
        """λ over the last second when the collector knows it, else the window's λ."""
        return self.arrival_rate_recent if self.arrival_rate_recent >= 0 else self.arrival_rate

    @property
    def in_flight(self) -> int:
        """Requests at this stage now: in service plus waiting (Knative's concurrency)."""
        return self.busy + self.queue_len


@dataclass(frozen=True, slots=True)
class PipelineSnapshot:
    """All stages of one model at one instant."""

    time: float  # seconds; wall clock live, simulated time in the simulator
    model: str
    stages: tuple[StageSnapshot, ...]
    slo_s: float = 0.0  # end-to-end SLO (k × profiled model time)
    window_s: float = 10.0  # length of the metrics window the rates came from
    compute_cores: float = 0.0  # cores the cpu_bound stages' replicas share (policies.compute_budget); 0 = not bounded


@dataclass(frozen=True, slots=True)
class StageDecision:
    """Desired state of one stage."""

    replicas: int
    cpus: float = 1.0
    reason: str = ""  # short human-readable why, for logs and reports


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer: one StageDecision per stage, in pipeline order."""

    time: float
    stages: tuple[StageDecision, ...]
    key_stages: tuple[int, ...] = field(default_factory=tuple)  # stages the corrector scaled up


class Policy(Protocol):
    """A scaling policy: pure apart from its own state. One that holds fixed counts (static-k, the oracle's
    schedule) says ``sessions_floor = False``: the controller then does not raise it for generation sessions
    (``policies.decode_capacity``)."""

    name: str

    def decide(self, snapshot: PipelineSnapshot) -> Decision: ...


def snapshot_from_json(data: Mapping[str, Any]) -> PipelineSnapshot:
    """A PipelineSnapshot back from the controller's JSONL log (to train the CV model: :mod:`.policies.cv_model`)."""
    tables = ("batch_service_s", "decode_service_s")
    stages = tuple(StageSnapshot(**{**s, **{t: tuple(tuple(row) for row in s.get(t, ())) for t in tables}})
                   for s in data["stages"])  # JSON gave lists: the snapshot holds tuples
    return PipelineSnapshot(time=data["time"], model=data["model"], stages=stages,
                            slo_s=data.get("slo_s", 0.0), window_s=data.get("window_s", 10.0))
