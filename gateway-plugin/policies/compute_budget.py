"""Never ask for a replica no core can compute (issue 39 item 4). Pure.

A stage that computes on the CPU (``QUART_COMPUTE=cpu``) holds ``cpus`` cores per replica while it computes. On one
machine every such replica shares that machine's cores: the 17th single-threaded replica on a 2-core host adds
contention, not capacity (measured: 16 replicas of SmolLM2 on 2 cores served 0.20 × vLLM's tokens per second). So
after the policy and the session floor have spoken, the stages that compute on the CPU share the snapshot's
``compute_cores``: their replicas × cpus are cut to it with the policy's own water-filling
(:func:`gateway_plugin.policies.provision.fair_shares`: in proportion to each stage's work, never below
``com.openfaas.scale.min`` nor the replicas busy now), one replica per stage at the least, since a pipeline whose stage
has none serves nothing. Only scale-ups are cut: replicas already there (an operator's `faas-cli scale`, an earlier
decision) go when the policy lets them go, as before. The load a cut stage cannot take in more replicas it takes in
larger batches: continuous decode batching (on by default, ``QUART_GEN_DECODE_BATCH_MAX``) and the router's one-shot
batches.

Emulated stages (the QUART paper's GPUs, a sleep per call) and GPU stages are not bounded here: their slots are the
hosts' (``--gpus-per-host``). ``compute_cores`` 0 turns the rule off (the standalone plugin on a cluster, where the
scheduler of the platform places pods on their own nodes; the simulator).
"""

from __future__ import annotations

import math
from dataclasses import replace

from gateway_plugin.policies.provision import fair_shares, floor_replicas
from gateway_plugin.snapshot import Decision, PipelineSnapshot


def compute_replicas(cores: float, cpus: float, stages: int) -> int:
    """Replicas of ``cpus`` cores each that ``cores`` compute at once, and at least one per stage."""
    return max(stages, math.floor(cores / max(cpus, 1e-9) + 1e-9))


def within_compute(snap: PipelineSnapshot, decision: Decision) -> Decision:
    """``decision`` with the CPU stages' replicas cut to the cores they share (unchanged when they fit)."""
    if snap.compute_cores <= 0:
        return decision
    bound = [k for k, stage in enumerate(snap.stages) if stage.cpu_bound]
    if not bound:
        return decision
    wants = [decision.stages[k] for k in bound]
    cpus = max(want.cpus for want in wants)
    capacity = compute_replicas(snap.compute_cores, cpus, len(bound))
    demands = [max(1, want.replicas) for want in wants]
    if sum(demands) <= capacity:
        return decision
    shares = fair_shares(tuple(snap.stages[k] for k in bound), demands, capacity)
    floors = [max(1, floor_replicas(snap.stages[k])) for k in bound]
    while sum(shares) > capacity:  # fair_shares keeps a floor of one replica a stage above its share: take the
        # excess back from the stages furthest above their floors (the heaviest first: the water-filling's order)
        above = [i for i in range(len(shares)) if shares[i] > floors[i]]
        if not above:
            break  # the floors alone exceed the cores: one replica a stage still runs
        shares[max(above, key=lambda i: (shares[i] - floors[i], -i))] -= 1
    stages = list(decision.stages)
    for k, share in zip(bound, shares, strict=True):
        want, stage = stages[k], snap.stages[k]
        allowed = max(share, stage.replicas + stage.pending_replicas)  # a scale-up only: what runs stays the policy's
        if allowed < want.replicas:
            stages[k] = replace(want, replicas=allowed, reason=want.reason + (
                f" (compute: {allowed} of {capacity} replicas on {snap.compute_cores:g} cores)"))
    return replace(decision, stages=tuple(stages))
