"""Helpers of the model-granular baselines (INFless, Cocktail): one replica count for every stage."""

from __future__ import annotations

from gateway_plugin.policies.batch_capacity import capacity_rate
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision


def model_rate(snapshot: PipelineSnapshot) -> float:
    """Requests/s entering the model (stage 0's recent arrival rate)."""
    return snapshot.stages[0].recent_rate if snapshot.stages else 0.0


def instance_throughput(snapshot: PipelineSnapshot, pipelined: bool) -> float:
    """Requests/s one model instance (one replica of every stage) sustains; 0 when unprofiled.

    Pipelined: the slowest stage bounds it. Not pipelined (the model as one function serving one
    request at a time): 1 / Σ service times.
    """
    if not snapshot.stages or any(s.service_rate <= 0 for s in snapshot.stages):
        return 0.0
    if pipelined:
        return min(capacity_rate(s) * max(1, s.concurrency) for s in snapshot.stages)
    return 1.0 / sum(s.mean_service_s for s in snapshot.stages)


def uniform_decision(snapshot: PipelineSnapshot, instances: int, reason: str) -> Decision:
    return Decision(
        snapshot.time,
        tuple(
            StageDecision(instances, s.cpus, reason)
            for s in snapshot.stages
        ),
    )


def current_instances(snapshot: PipelineSnapshot) -> int:
    return max((s.replicas + s.pending_replicas for s in snapshot.stages), default=0)
