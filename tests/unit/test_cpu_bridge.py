"""CPU compensation while a stage's new replicas start (issue 32): the bridge's grant, QUART granting and
releasing it, the one convergence's in-place ``resize``, and the simulator carrying it out."""

from __future__ import annotations

import pytest
from gateway_plugin.config import CPUConfig, QuartConfig
from gateway_plugin.policies import make_policy
from gateway_plugin.policies.cpu_bridge import bridge_cpus
from gateway_plugin.policies.quart import QuartPolicy
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot
from quart_kernel.convergence import FunctionView, PlatformView, ReplicaView, converge
from quart_kernel.scheduling import make_placer
from quart_tools.sim.calibration import Calibration

AMDAHL = Calibration(cpu_fraction=0.795)  # QUART Fig. 3b's hardware: t(c)/t(1) = 1 − f + f/c


def _ratio(a: float, b: float) -> float:
    return AMDAHL.cpu_factor(b) / AMDAHL.cpu_factor(a)


def test_bridge_grants_the_fewest_cpus_that_carry_the_asked_capacity() -> None:
    cfg = CPUConfig(cpu_max=8.0, cpu_step=0.5)
    # 2 of 4 ready: each must serve twice as fast, 1 − f + f/c ≤ 0.5 → c ≥ 2.69 → 3.0
    assert bridge_cpus(2, 4, cfg, _ratio) == 3.0
    assert _ratio(1, 3.0) <= 0.5 < _ratio(1, 2.5)
    assert bridge_cpus(1, 8, cfg, _ratio) == 8.0  # out of reach: the most that helps (CPU_max)
    assert bridge_cpus(4, 4, cfg, _ratio) == 1.0 and bridge_cpus(5, 4, cfg, _ratio) == 1.0  # nothing starts
    assert bridge_cpus(0, 4, cfg, _ratio) == 1.0  # no ready replica to give CPUs to
    assert bridge_cpus(2, 4, cfg, lambda a, b: 1.0) == 1.0  # CPUs do not help (this VM's profile): none granted
    assert bridge_cpus(2, 4, cfg, lambda a, b: b / a) == 1.0  # they slow it: none granted


def _snapshot(t: float, ready: int, pending: int, cpus: float = 1.0) -> PipelineSnapshot:
    st = StageSnapshot(name="m-stage-0", index=0, arrival_rate=30.0, service_rate=10.0, replicas=ready,
                       pending_replicas=pending, max_replicas=8, target_s=0.3, cpus=cpus, cv_arrival=1.0)
    return PipelineSnapshot(time=t, model="m", stages=(st,), window_s=10.0)


def test_quart_bridges_a_stage_while_its_replicas_start_and_gives_the_cpus_back() -> None:
    cpu_model = AMDAHL.cpu_model()
    policy = QuartPolicy(QuartConfig(cpu=CPUConfig(cpu_max=8.0, cpu_step=1.0)), cpu_model=cpu_model)
    up = policy.decide(_snapshot(10.0, 1, 0)).stages[0]  # 30 req/s at 10/s per replica: Correct asks for more
    assert up.replicas > 1 and up.cpus > 1.0 and "bridge cpus 1->" in up.reason
    assert cpu_model.service_ratio(1.0, up.cpus) <= 1 / up.replicas + 0.05 or up.cpus == 8.0
    starting = policy.decide(_snapshot(11.0, 1, up.replicas - 1, up.cpus)).stages[0]
    assert starting.cpus == up.cpus  # still starting: still bridged
    done = policy.decide(_snapshot(12.0, up.replicas, 0, up.cpus)).stages[0]
    assert done.replicas == up.replicas and done.cpus == 1.0 and "bridge cpus" in done.reason
    off = QuartPolicy(QuartConfig(cpu=CPUConfig(enabled=False)), cpu_model=cpu_model)
    assert off.decide(_snapshot(10.0, 1, 0)).stages[0].cpus == 1.0  # QUART − CPU compensation
    nobridge = QuartPolicy(QuartConfig(cpu=CPUConfig(bridge=False)), cpu_model=cpu_model)
    assert nobridge.decide(_snapshot(10.0, 1, 0)).stages[0].cpus == 1.0


def test_convergence_resizes_ready_replicas_in_place() -> None:
    reps = (ReplicaView("a", "ready", 1, cpus=1.0), ReplicaView("b", "ready", 1, cpus=3.0),
            ReplicaView("c", "starting", 1, cpus=1.0), ReplicaView("d", "ready", 1, cpus=0.0))
    view = PlatformView(0.0, (FunctionView("f", 4, 1, reps, cpus=3.0),
                              FunctionView("g", 1, 1, (ReplicaView("e", "ready", 1, cpus=1.0),))))
    plan = converge(view, make_placer("first-fit"))
    resizes = [(a.function, a.replica, a.cpus) for a in plan.actions if a.kind == "resize"]
    assert resizes == [("f", "a", 3.0)]  # not b (has them), c (starting), d (reports none), g (unmanaged)
    shrunk = PlatformView(0.0, (FunctionView("f", 1, 1, reps[:2], cpus=2.0),))
    kinds = {(a.kind, a.replica) for a in converge(shrunk, make_placer("first-fit")).actions}
    assert ("resize", "a") in kinds or ("resize", "b") in kinds
    assert not any(("resize", r) in kinds and ("stop", r) in kinds for r in "ab")  # a leaving one is not resized


def test_simulated_bridge_resizes_in_place_and_charges_cpu_seconds() -> None:
    import numpy as np
    from quart_tools.arrivals import poisson_arrivals
    from quart_tools.sim.engine import SimConfig, Simulation, StageSpec

    cal = Calibration(hosts=1, gpus_per_host=4, cpu_fraction=0.795)  # cold starts ≈ 18 s
    cfg = SimConfig(model="m", stages=(StageSpec("m-stage-0", 0.1, 2 * 10**9),), slo_s=0.3, calibration=cal,
                    hop_s=0.0, queue_cap=10**9, initial_replicas=1, max_replicas=4, placer="first-fit",
                    keysmanager=False)
    arrivals = poisson_arrivals(20.0, 60.0, seed=3)  # twice what the one replica serves; new ones start cold
    on = Simulation(cfg, make_policy("quart", cpu_model=cal.cpu_model()), arrivals).run()
    off = Simulation(cfg, make_policy("quart", cpu={"enabled": False}), arrivals).run()
    assert off.cpu_seconds == pytest.approx(off.gpu_seconds)  # 1 CPU per replica throughout
    assert on.cpu_seconds > 1.2 * on.gpu_seconds  # CPUs granted while the cold starts run ...
    assert np.nanmean(on.latencies_ms) < 0.8 * np.nanmean(off.latencies_ms)  # ... and they shorten the queue
    assert len(on.launched) <= len(off.launched)  # in place: no replica restarted for a CPU change


def test_live_cpu_ablation_counts_cpu_seconds_and_fits_the_emulated_law() -> None:
    import argparse

    from gateway_plugin.policies.cpu_model import CPULatencyModel
    from quart_tools.bench.cpu_ablation import _args, cpu_profile_records, cpu_seconds

    timeline = [{"time": 0.0, "replicas": [1, 2], "cpus": [1.0, 1.0]},
                {"time": 1.0, "replicas": [1, 2], "cpus": [2.0, 1.0]},
                {"time": 3.0, "replicas": [2, 2], "cpus": [1.0, 1.0]}]
    assert cpu_seconds(timeline) == (3.0 * 1 + 4.0 * 2, 1)  # 3 CPU-s in the first second, 4 × 2 s after
    model = CPULatencyModel.fit(cpu_profile_records(0.795, 2.0))
    assert model.service_ratio(1, 2) == pytest.approx(AMDAHL.cpu_factor(2), rel=1e-6)  # 1 − f + f/2
    ns = argparse.Namespace(cpu_max=2.0, start_replicas=1)
    assert '"enabled": false' in _args(ns, "-cpu").policy_config[0]
    assert "enabled" not in _args(ns, "quart").policy_config[0] and '"cpu_max": 2.0' in _args(ns, "quart").policy_config[0]
