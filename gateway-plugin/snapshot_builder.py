"""Turns the router's live state and the metrics windows into a ``PipelineSnapshot`` for a policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot
from quart_stage.labels import DEFAULT_MAX_REPLICAS, DEFAULT_MIN_REPLICAS


@dataclass(frozen=True, slots=True)
class StageState:
    """What the platform says of one stage function right now."""

    ready: int
    desired: int
    cpus: float = 1.0
    min_replicas: int = DEFAULT_MIN_REPLICAS
    max_replicas: int = DEFAULT_MAX_REPLICAS
    concurrency: int = 1
    param_bytes: int = 0
    profiled_service_s: float = 0.0  # from a profile label; 0 = use the measured service time
    start_s: float = -1.0  # measured ask → ready time of the function's recent replicas; −1 = unknown
    batch_max: int = 1  # com.quart.batch.max (1: the router does not batch this stage)
    batch_profile_s: tuple[tuple[int, float], ...] = ()  # profiled (size, service s) (com.quart.batch.profile-ms)
    cpu_bound: bool = False  # a model stage computing on the CPU (QUART_COMPUTE=cpu), not emulated nor on a GPU


def with_profile(measured: tuple[tuple[int, int, float], ...],
                 profile: tuple[tuple[int, float], ...]) -> tuple[tuple[int, int, float], ...]:
    """The measured service time by batch size, plus the profiled sizes not measured yet (as 0 calls)."""
    seen = {size for size, _, _ in measured}
    return tuple(sorted(measured + tuple((size, 0, s) for size, s in profile if size not in seen)))


class Inventory(Protocol):
    """The platform's view of pipelines and their stage functions (embedded gateway or OpenFaaS)."""

    def pipelines(self) -> dict[str, list[str]]: ...

    def stage_state(self, function: str) -> StageState: ...


class GenerationView(Protocol):
    """The generation engine's sessions per stage (``SessionEngine.stage_generation``)."""

    def stage_generation(self, function: str) -> tuple[int, int, int]: ...  # sessions, kv booked, kv capacity

    def stage_decode(self, function: str) -> tuple[tuple[tuple[int, int, float], ...], int]: ...  # table, batch max


class QueueView(Protocol):
    def queue_len(self, function: str) -> int: ...

    def busy(self, function: str) -> int: ...


def build_snapshot(
    now: float,
    model: str,
    functions: list[str],
    inventory: Inventory,
    queues: QueueView,
    collector: MetricsCollector,
    slo_factor: float,
    slo_s: Mapping[str, float] | None = None,
    generation: GenerationView | None = None,
    compute_cores: float = 0.0,
) -> PipelineSnapshot:
    """One model's snapshot. The SLO is ``slo_s[model]`` when given, else slo_factor × Σ service times;
    ``generation`` adds each stage's sessions, KV-cache occupancy and decode steps by batch size;
    ``compute_cores``: the cores its CPU stages share (0: not bounded)."""
    window = collector.window_s
    stages = []
    total_service = 0.0
    for index, fn in enumerate(functions):
        state = inventory.stage_state(fn)
        m = collector.stage(fn)
        service_s = m.mean_service_s(now) or state.profiled_service_s
        total_service += state.profiled_service_s or service_s
        ready = max(0, state.ready)
        util = m.busy_s(now) / (max(1, ready) * max(1, state.concurrency) * window)
        sessions, kv_tokens, kv_capacity = generation.stage_generation(fn) if generation is not None else (0, 0, 0)
        decode_table, decode_max = generation.stage_decode(fn) if generation is not None else ((), 1)
        stages.append(StageSnapshot(
            name=fn, index=index,
            arrival_rate=m.arrival_rate(now),
            service_rate=1.0 / service_s if service_s > 0 else 0.0,
            replicas=ready,
            pending_replicas=max(0, state.desired - ready),
            busy=queues.busy(fn),
            queue_len=queues.queue_len(fn),
            mean_wait_s=m.mean_wait_s(now),
            cv_arrival=m.cv_arrival(now),
            utilisation=min(1.5, util),
            cpus=state.cpus,
            min_replicas=state.min_replicas,
            max_replicas=state.max_replicas,
            param_bytes=state.param_bytes,
            activation_bytes=m.mean_activation_bytes(now),
            concurrency=state.concurrency,
            arrival_rate_recent=m.recent_rate(now)[0],  # since the traffic began when that is < 1 s
            replica_start_s=state.start_s,
            sessions=sessions, kv_tokens=kv_tokens, kv_capacity=kv_capacity,
            batch_service_s=with_profile(m.batch_service_s(), state.batch_profile_s), batch_max=state.batch_max,
            decode_service_s=decode_table, decode_batch_max=decode_max, cpu_bound=state.cpu_bound,
        ))
    slo = (slo_s or {}).get(model, 0.0) or slo_factor * total_service
    return PipelineSnapshot(time=now, model=model, stages=tuple(stages), slo_s=slo, window_s=window,
                            compute_cores=compute_cores)
