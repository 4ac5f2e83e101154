"""The sessions' floor of a generating stage (gateway_plugin.policies.decode_capacity)."""

from __future__ import annotations

from gateway_plugin.policies.decode_capacity import (
    KV_HEADROOM,
    session_floor,
    sessions_per_replica,
    with_session_floor,
)
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision, StageSnapshot

TABLE = ((1, 40, 0.030), (2, 30, 0.040), (4, 20, 0.060), (8, 10, 0.100))  # S(b) = 20 ms + 10 ms a session


def stage(index: int = 0, sessions: int = 0, table=TABLE, batch_max: int = 8, replicas: int = 2,
          kv_tokens: int = 0, kv_capacity: int = 0) -> StageSnapshot:
    return StageSnapshot(name=f"m-{index}", index=index, arrival_rate=0.0, service_rate=0.0, replicas=replicas,
                         sessions=sessions, kv_tokens=kv_tokens, kv_capacity=kv_capacity,
                         decode_service_s=table, decode_batch_max=batch_max)


def test_a_replica_carries_the_sessions_whose_steps_fit_the_share() -> None:
    assert sessions_per_replica(stage(), 0.050) == 3  # S(3) = 50 ms: the largest batch within 50 ms
    assert sessions_per_replica(stage(), 0.100) == 8  # a full batch fits once
    assert sessions_per_replica(stage(), 0.250) == 16  # two full batches one after another
    assert sessions_per_replica(stage(batch_max=1, table=((1, 9, 0.030),)), 0.100) == 3  # no batching: in turn
    assert sessions_per_replica(stage(), 0.010) == 1  # not even one fits: one each, the least it can be
    assert sessions_per_replica(stage(table=()), 0.100) == 0  # nothing measured: no bound
    assert sessions_per_replica(stage(), 0.0) == 0  # no target: no bound


def test_the_tpot_target_is_shared_by_each_stages_single_step() -> None:
    """Two stages, the second's single step twice the first's: the first gets a third of the target, the second two."""
    slow = ((1, 10, 0.060), (8, 10, 0.200))  # S(b) = 40 ms + 20 ms a session
    snap = PipelineSnapshot(time=0.0, model="m", stages=(stage(0, sessions=16), stage(1, sessions=16, table=slow)))
    (first, why0), (second, why1) = session_floor(snap, 0.285)  # shares 95 ms and 190 ms
    assert (first, second) == (3, 3)  # 16 sessions at 7 a replica on both: S(7) = 90 ms and 180 ms
    assert "<= 7 a replica within TPOT share 95 ms" in why0 and "share 190 ms" in why1


def test_kv_room_raises_a_stage_whose_booking_nears_what_it_holds() -> None:
    near = stage(sessions=10, kv_tokens=7000, kv_capacity=8192, replicas=2)  # 0.85 of what two replicas hold
    snap = PipelineSnapshot(time=0.0, model="m", stages=(near,))
    assert 7000 / 8192 > KV_HEADROOM
    assert session_floor(snap, 0.0) == ((3, "KV 7000/8192 booked"),)
    calm = PipelineSnapshot(time=0.0, model="m", stages=(stage(sessions=2, kv_tokens=1000, kv_capacity=8192),))
    assert session_floor(calm, 0.0)[0][0] == 1


def test_the_floor_only_raises_and_leaves_stages_without_sessions_alone() -> None:
    snap = PipelineSnapshot(time=0.0, model="m", stages=(stage(0, sessions=20), stage(1, table=())))
    decision = Decision(0.0, (StageDecision(2, reason="policy"), StageDecision(1)))
    raised = with_session_floor(snap, decision, 0.100)
    assert [s.replicas for s in raised.stages] == [3, 1]  # 20 sessions at 8 a replica
    assert raised.stages[0].reason.startswith("policy; sessions: 20 sessions")
    assert with_session_floor(snap, Decision(0.0, (StageDecision(5), StageDecision(1))), 0.100).stages[0].replicas == 5
    idle = PipelineSnapshot(time=0.0, model="m", stages=(stage(0), stage(1)))
    assert with_session_floor(idle, decision, 0.100) is decision
