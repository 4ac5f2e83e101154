"""QUART's CPU compensation (§5.3) with a profiled signal: the regression's ratios, AllocateCPU on stages
over their target, CPUs back when the target is met, the simulator's self-profile, and granted CPUs as the
replica's torch threads (nothing in its environment overrides them)."""

from __future__ import annotations

import json
import math

import pytest
from gateway_plugin.config import CPUConfig, QuartConfig
from gateway_plugin.policies import make_policy
from gateway_plugin.policies.cpu_model import DEFAULT_PROFILE, CPULatencyModel, default_cpu_model
from gateway_plugin.policies.quart import QuartPolicy
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot
from quart_tools.sim.calibration import Calibration


def _records(fixed_s: float, parallel_s: float, cpu_max: int = 4) -> list[dict]:
    """Service = fixed + parallel / c (exact), at 1…cpu_max CPUs and two activation sizes."""
    return [{"cpus": c, "queue_len": 0, "param_bytes": 1e8, "activation_bytes": a,
             "service_ms": 1000 * (fixed_s + parallel_s / c)} for c in range(1, cpu_max + 1) for a in (1e5, 1e5)]


def _stage(**kw) -> StageSnapshot:
    base = dict(name="m-stage-0", index=0, arrival_rate=9.0, service_rate=10.0, replicas=1, max_replicas=1,
                target_s=0.3, cpus=1.0, cv_arrival=1.0)
    base.update(kw)
    return StageSnapshot(**base)


def _decide(policy: QuartPolicy, st: StageSnapshot):
    return policy.decide(PipelineSnapshot(time=100.0, model="m", stages=(st,), window_s=10.0)).stages[0]


def test_fit_recovers_the_cpu_scaling_as_ratios_and_fraction() -> None:
    model = CPULatencyModel.fit(_records(0.1, 0.3))
    assert model.r2 == pytest.approx(1.0)
    assert model.service_ratio(1, 2) == pytest.approx(0.25 / 0.4)
    assert model.service_ratio(2, 1) == pytest.approx(0.4 / 0.25)
    assert model.cpu_fraction() == pytest.approx(0.75, abs=1e-6)
    flat = CPULatencyModel.fit(_records(0.2, 0.0))
    assert flat.cpu_fraction() == pytest.approx(0.0, abs=1e-6)


def test_default_model_is_fitted_on_the_shipped_profile() -> None:
    rows = [json.loads(line) for line in DEFAULT_PROFILE.read_text().splitlines() if line.strip()]
    assert len(rows) >= 3 and {r["cpus"] for r in rows} >= {1, 2}  # recorded at 1 and 2 CPUs
    model = default_cpu_model()
    assert model.records == len(rows) and math.isfinite(model.service_ratio(1, 2))
    assert make_policy("quart").cpu_model is model
    assert make_policy("quart", cpu_model=None).cpu_model is None


def test_allocate_grants_cpus_to_a_stage_over_target_that_cannot_grow() -> None:
    # at its maximum (1 replica), ρ = 0.9: M/M/1 delay 1 s > 0.3 s; at 4 CPUs service 0.1 × 0.4 s → ρ = 0.36
    st = _stage()
    helps = _decide(QuartPolicy(QuartConfig(cpu=CPUConfig(cpu_max=4.0, cpu_step=1.0, allocate=True)),
                                cpu_model=CPULatencyModel.fit(_records(0.1, 0.3))), st)
    assert helps.replicas == 1 and 1.0 < helps.cpus <= 4.0 and "allocate cpus" in helps.reason
    default = _decide(QuartPolicy(QuartConfig(cpu=CPUConfig(cpu_max=4.0)), cpu_model=CPULatencyModel.fit(_records(0.1, 0.3))), st)
    assert default.cpus == 1.0  # AllocateCPU beyond Smooth's reclaims is opt-in (CPUConfig.allocate)
    off = _decide(QuartPolicy(QuartConfig(cpu=CPUConfig(enabled=False)), cpu_model=CPULatencyModel.fit(_records(0.1, 0.3))), st)
    assert off.cpus == 1.0
    useless = _decide(QuartPolicy(QuartConfig(cpu=CPUConfig(cpu_max=4.0, allocate=True)), cpu_model=CPULatencyModel.fit(_records(0.2, 0.0))), st)
    assert useless.cpus == 1.0  # the profile says more CPUs do not shorten service: none granted
    # the granted count is the smallest that meets the target (predicted from the measured 0.1 s × the ratio)
    model = CPULatencyModel.fit(_records(0.1, 0.3))
    c = helps.cpus
    assert 1 / (10.0 / model.service_ratio(1, c)) < 1 / 9.0 or c == 4.0


def test_no_cpu_roll_while_replicas_start_and_one_change_per_hold() -> None:
    model = CPULatencyModel.fit(_records(0.1, 0.3))
    policy = QuartPolicy(QuartConfig(cpu=CPUConfig(cpu_max=4.0, hold_s=30.0, allocate=True, bridge=False)),
                         cpu_model=model)
    assert _decide(policy, _stage(pending_replicas=1)).cpus == 1.0  # AllocateCPU waits for the start (the bridge acts)
    assert _decide(policy, _stage()).cpus > 1.0  # t = 100: granted
    calm = _stage(arrival_rate=0.5, cpus=4.0, service_rate=10.0 / model.service_ratio(1, 4))
    held = policy.decide(PipelineSnapshot(time=110.0, model="m", stages=(calm,), window_s=10.0)).stages[0]
    assert held.cpus == 4.0  # within hold_s of the grant: kept although the target is met without them
    later = policy.decide(PipelineSnapshot(time=131.0, model="m", stages=(calm,), window_s=10.0)).stages[0]
    assert later.cpus == 1.0


def test_cpus_go_back_to_default_when_the_target_is_met_without_them() -> None:
    policy = QuartPolicy(QuartConfig(cpu=CPUConfig(cpu_max=4.0, allocate=True)), cpu_model=CPULatencyModel.fit(_records(0.1, 0.3)))
    calm = _stage(arrival_rate=1.0, cpus=3.0, service_rate=10.0 / (0.2 / 0.4))  # measured at 3 CPUs
    assert _decide(policy, calm).cpus == 1.0


def test_simulator_profiles_its_own_replicas() -> None:
    cal = Calibration()
    model = cal.cpu_model()
    for c in (2, 4, 8):
        assert model.service_ratio(1, c) == pytest.approx(cal.cpu_factor(c) / cal.cpu_factor(1), rel=1e-6)
    assert model.cpu_fraction() == pytest.approx(cal.cpu_fraction, abs=1e-6)


def test_simulator_calibrates_from_a_live_profile(tmp_path) -> None:
    path = tmp_path / "profile.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(0.1, 0.3)))
    cal = Calibration().with_cpu_profile(path)
    assert cal.cpu_fraction == pytest.approx(0.75, abs=1e-6) and str(path) in cal.sources["cpu_fraction"]


def test_granted_cpus_are_the_replicas_threads() -> None:
    from quart_provider.hosts import ReplicaSpec
    from quart_provider.keysmanager_host import _stage as km_stage

    from keysmanager.replicas import threads_of
    from keysmanager.types import StageSpec

    assert threads_of(StageSpec("f", env={"QUART_THREADS": "1"}, cpus=2.0)) == 2  # the env does not override
    assert threads_of(StageSpec("f", cpus=1.5)) == 2
    limited = ReplicaSpec(function="f", kind="stage", env={"QUART_THREADS": "1"}, cpus=3.0)
    assert km_stage(limited).cpus == 3.0
    unlimited = ReplicaSpec(function="f", kind="stage", env={"QUART_THREADS": "2"})
    assert km_stage(unlimited).cpus == 2.0


def test_simulated_quart_compensates_a_stage_at_its_maximum() -> None:
    import numpy as np
    from quart_tools.arrivals import poisson_arrivals
    from quart_tools.sim.engine import SimConfig, Simulation, StageSpec

    cal = Calibration(hosts=1, gpus_per_host=2)  # a second slot for the rolling update's new replica
    cfg = SimConfig(model="m", stages=(StageSpec("m-stage-0", 0.1, 2 * 10**9),), slo_s=0.3, calibration=cal,
                    hop_s=0.0, queue_cap=10**9, initial_replicas=1, max_replicas=1, placer="first-fit")
    arrivals = poisson_arrivals(9.0, 90.0, seed=3)  # ρ = 0.9 on the one replica it may have
    on = Simulation(cfg, make_policy("quart", cpu_model=cal.cpu_model(), cpu={"allocate": True}), arrivals).run()
    default = Simulation(cfg, make_policy("quart", cpu_model=cal.cpu_model()), arrivals).run()
    assert default.cpu_seconds == pytest.approx(default.gpu_seconds)  # by default only Smooth's reclaims compensate
    off = Simulation(cfg, make_policy("quart", cpu={"enabled": False}), arrivals).run()
    assert off.cpu_seconds == pytest.approx(off.gpu_seconds)  # 1 CPU per replica throughout
    assert on.cpu_seconds > 1.5 * on.gpu_seconds  # CPUs granted ...
    assert np.nanmean(on.latencies_ms) < 0.5 * np.nanmean(off.latencies_ms)  # ... and they shorten the queue


def test_a_stage_pod_asks_the_keysmanager_for_its_cpu_limit(tmp_path) -> None:
    from quart_stage.config import StageConfig
    from quart_stage.nodecache import cgroup_cpus, stage_spec

    cpu_max = tmp_path / "cpu.max"
    cfg = StageConfig(model_dir="/models/m", stage_index=0, num_stages=2, threads=1)
    cpu_max.write_text("250000 100000\n")
    assert cgroup_cpus(str(cpu_max)) == 2.5 and stage_spec(cfg, str(cpu_max))["cpus"] == 2.5
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpus(str(cpu_max)) is None and stage_spec(cfg, str(cpu_max))["cpus"] == 1.0
    assert cgroup_cpus(str(tmp_path / "absent")) is None
