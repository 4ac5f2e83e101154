"""How many replicas a generating stage needs for the sessions it holds (issue 28, item 3; docs/policies.md "Batching").

A stage of a decoder runs generation sessions besides one-shot passes: each session holds a KV cache on one
replica for its whole life and asks that replica for one decode step per token. The request-rate models
(M/M/c, ``batch_capacity``) do not see them, so every policy's decision passes through one floor here, applied
by the controller beside the scale bounds (``Controller.decide``), live and in the simulator:

* **Decode batching.** The session engine records each batched decode step's service time by batch size
  (``StageSnapshot.decode_service_s``); ``batch_capacity.fit`` gives S(b) = F + P·b. With a TPOT target the
  stage's share of it is ``tpot · S_k(1) / Σ_j S_j(1)`` (its part of one step through the pipeline), and one
  replica carries the most sessions whose steps all run within that share: B·⌊share / S(B)⌋ when a full batch
  fits (full batches one after another), else max{b ≤ B: S(b) ≤ share} (B: ``com.quart.batch.decode-max``;
  B = 1 without decode batching, where a replica runs its sessions' steps one after another).
  Without a TPOT target the step rate says nothing and only the KV room counts.
* **KV room.** Sessions book prompt + max_tokens positions; a replica holds ``kv_capacity / replicas`` of them.
  The stage keeps its booking under ``KV_HEADROOM`` of what its replicas hold, so the next session finds room
  instead of a 429 while a replica starts.

Pure: a function of the snapshot (no I/O, no clock).
"""

from __future__ import annotations

import math
from dataclasses import replace

from gateway_plugin.policies.batch_capacity import BatchProfile, fit
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageSnapshot

__all__ = ["KV_HEADROOM", "sessions_per_replica", "session_floor", "with_session_floor"]

KV_HEADROOM = 0.8  # booked positions per held position above which a generating stage asks for one more replica


def sessions_per_replica(stage: StageSnapshot, share_s: float, profile: BatchProfile | None = None) -> int:
    """Sessions one replica carries with its decode step within ``share_s`` (0: no bound known); ``profile``: the
    stage's decode fit when the caller has it."""
    profile = profile or fit(stage.decode_service_s, max(1, stage.decode_batch_max))
    if profile is None or share_s <= 0:
        return 0
    batch = max(1, stage.decode_batch_max)
    if profile.service_s(batch) <= share_s:  # full batches, one after another, each session once per round
        return batch * int(share_s // profile.service_s(batch))
    fitting = [b for b in range(1, batch + 1) if profile.service_s(b) <= share_s]
    return max(fitting) if fitting else 1


def session_floor(snap: PipelineSnapshot, tpot_s: float) -> tuple[tuple[int, str], ...]:
    """Per stage: the replicas its sessions need (0 where none), and why."""
    profiles = [fit(s.decode_service_s, max(1, s.decode_batch_max)) for s in snap.stages]
    singles = [p.service_s(1) if p is not None else 0.0 for p in profiles]
    total = sum(singles)
    floors = []
    for stage, single, profile in zip(snap.stages, singles, profiles, strict=True):
        if stage.sessions <= 0:
            floors.append((0, ""))
            continue
        need, why = 0, ""
        if stage.kv_capacity > 0 and stage.replicas > 0:
            per_replica = stage.kv_capacity / stage.replicas
            need = math.ceil(stage.kv_tokens / (KV_HEADROOM * per_replica))
            why = f"KV {stage.kv_tokens}/{stage.kv_capacity} booked"
        if tpot_s > 0 and total > 0:
            share = tpot_s * (single / total if single > 0 else 1 / len(snap.stages))
            per = sessions_per_replica(stage, share, profile)
            if per and math.ceil(stage.sessions / per) > need:
                need = math.ceil(stage.sessions / per)
                why = f"{stage.sessions} sessions at <= {per} a replica within TPOT share {1000 * share:.0f} ms"
        floors.append((need, why))
    return tuple(floors)


def with_session_floor(snap: PipelineSnapshot, decision: Decision, tpot_s: float) -> Decision:
    """``decision`` with each generating stage at least at its session floor (reasons say where it raised it)."""
    floors = session_floor(snap, tpot_s)
    if not any(need for need, _ in floors):
        return decision
    stages = tuple(
        replace(want, replicas=need, reason=f"{want.reason}; sessions: {why}" if want.reason else f"sessions: {why}")
        if need > want.replicas else want
        for want, (need, why) in zip(decision.stages, floors, strict=True))
    return replace(decision, stages=stages)
