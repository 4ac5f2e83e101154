"""The compute budget (gateway_plugin.policies.compute_budget): CPU stages share the machine's cores."""

from __future__ import annotations

from dataclasses import replace

from gateway_plugin.config import PluginConfig
from gateway_plugin.policies.compute_budget import compute_replicas, within_compute
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision, StageSnapshot
from quart_stage.config import computes_on_cpu


def _stage(index: int, cpu_bound: bool = True, service_s: float = 0.02, min_replicas: int = 1, busy: int = 0
           ) -> StageSnapshot:
    return StageSnapshot(name=f"m-stage-{index}", index=index, arrival_rate=50.0, service_rate=1 / service_s,
                         replicas=1, min_replicas=min_replicas, busy=busy, cpu_bound=cpu_bound)


def _decide(snap: PipelineSnapshot, *replicas: int) -> Decision:
    return Decision(snap.time, tuple(StageDecision(r, reason="policy") for r in replicas))


def test_compute_replicas_is_cores_over_cpus_and_one_per_stage_at_least() -> None:
    assert compute_replicas(2, 1.0, 3) == 3
    assert compute_replicas(16, 1.0, 3) == 16
    assert compute_replicas(16, 2.0, 3) == 8
    assert compute_replicas(2.0, 0.5, 1) == 4


def test_the_issue_case_4_6_6_on_two_cores_is_one_replica_a_stage() -> None:
    snap = PipelineSnapshot(0.0, "m", tuple(_stage(k) for k in range(3)), compute_cores=2.0)
    out = within_compute(snap, _decide(snap, 4, 6, 6))
    assert [s.replicas for s in out.stages] == [1, 1, 1]
    assert all("compute: 1 of 3 replicas on 2 cores" in s.reason for s in out.stages)


def test_a_heavier_stage_takes_no_replica_the_floors_of_the_others_already_spent() -> None:
    # seen live: stage 0 (twice the work) got 2 of 3 while the others kept their floor of 1: 4 replicas on 2 cores
    stages = (_stage(0, service_s=0.04), _stage(1), _stage(2))
    snap = PipelineSnapshot(0.0, "m", stages, compute_cores=2.0)
    assert [s.replicas for s in within_compute(snap, _decide(snap, 3, 1, 1)).stages] == [1, 1, 1]
    assert [s.replicas for s in within_compute(snap, _decide(snap, 4, 6, 6)).stages] == [1, 1, 1]


def test_cores_are_shared_in_proportion_to_each_stage_work() -> None:
    stages = (_stage(0, service_s=0.01), _stage(1, service_s=0.03), _stage(2, service_s=0.01))
    snap = PipelineSnapshot(0.0, "m", stages, compute_cores=10.0)
    out = within_compute(snap, _decide(snap, 6, 12, 6))
    replicas = [s.replicas for s in out.stages]
    assert sum(replicas) == 10 and replicas[1] == max(replicas) and replicas[1] >= 5


def test_only_scale_ups_are_cut_what_runs_stays() -> None:
    stages = tuple(replace(_stage(k), replicas=r, pending_replicas=p) for k, (r, p) in enumerate([(3, 0), (1, 1), (1, 0)]))
    snap = PipelineSnapshot(0.0, "m", stages, compute_cores=2.0)
    assert [s.replicas for s in within_compute(snap, _decide(snap, 4, 6, 6)).stages] == [3, 2, 1]
    assert [s.replicas for s in within_compute(snap, _decide(snap, 2, 1, 1)).stages] == [2, 1, 1]  # downs are the policy's


def test_within_the_budget_nothing_changes() -> None:
    snap = PipelineSnapshot(0.0, "m", tuple(_stage(k) for k in range(3)), compute_cores=16.0)
    decision = _decide(snap, 4, 6, 6)
    assert within_compute(snap, decision) is decision


def test_emulated_stages_and_an_unbounded_snapshot_are_not_cut() -> None:
    emulated = PipelineSnapshot(0.0, "m", tuple(_stage(k, cpu_bound=False) for k in range(3)), compute_cores=2.0)
    assert [s.replicas for s in within_compute(emulated, _decide(emulated, 4, 6, 6)).stages] == [4, 6, 6]
    off = PipelineSnapshot(0.0, "m", tuple(_stage(k) for k in range(3)), compute_cores=0.0)
    assert [s.replicas for s in within_compute(off, _decide(off, 4, 6, 6)).stages] == [4, 6, 6]
    mixed = PipelineSnapshot(0.0, "m", (_stage(0), _stage(1, cpu_bound=False), _stage(2)), compute_cores=2.0)
    assert [s.replicas for s in within_compute(mixed, _decide(mixed, 4, 6, 6)).stages] == [1, 6, 1]


def test_the_floor_is_scale_min_and_the_replicas_busy_now() -> None:
    stages = (_stage(0, min_replicas=2), _stage(1, busy=3), _stage(2))
    snap = PipelineSnapshot(0.0, "m", stages, compute_cores=2.0)
    assert [s.replicas for s in within_compute(snap, _decide(snap, 4, 6, 6)).stages] == [2, 3, 1]


def test_a_model_stage_on_the_cpu_is_what_counts() -> None:
    assert computes_on_cpu({"QUART_MODEL_DIR": "/m"})
    assert computes_on_cpu({"QUART_MODEL_URL": "s3://b/m", "QUART_COMPUTE": " CPU "})
    assert not computes_on_cpu({"QUART_MODEL_DIR": "/m", "QUART_COMPUTE": "emulated"})
    assert not computes_on_cpu({"QUART_MODEL_DIR": "/m", "QUART_COMPUTE": "cuda"})
    assert not computes_on_cpu({})  # quart/echo and other processes


def test_the_setting_defaults_to_auto() -> None:
    assert PluginConfig().compute_cores == -1.0
    assert PluginConfig.from_env({"QUART_COMPUTE_CORES": "4"}).compute_cores == 4.0
