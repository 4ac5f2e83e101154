"""One path from decision to action: the simulator drives the live Controller, and a simulated control step
takes the same actions as a live one (the embedded gateway behind the plugin's inventory) on the same state."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
from gateway_plugin.actuators.gateway import GatewayActuator
from gateway_plugin.controller import Controller
from gateway_plugin.plugin import GatewayView
from gateway_plugin.policies import make_policy
from quart_provider.deployment import FunctionDeployment
from quart_provider.replicaset import StartTimeEstimate, choose_surplus
from quart_stage import labels
from quart_tools.arrivals import Arrivals
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec, drive

from tests.test_gateway_core import FakeHost, make, settle

MB = 1_000_000


class Recorder:
    """Wraps an actuator and keeps every call it passes on."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        self.calls.append(("scale", function, replicas, key))
        await self.inner.scale(function, replicas, key=key)

    async def set_cpus(self, function: str, cpus: float) -> None:
        self.calls.append(("cpus", function, cpus))
        await self.inner.set_cpus(function, cpus)


def _burst_sim(mode: str = "provision") -> Simulation:
    """A 3-stage pipeline whose middle stage is the bottleneck, stopped in the middle of a burst."""
    stages = (StageSpec("m-0", 0.02, 10 * MB), StageSpec("m-1", 0.1, 10 * MB), StageSpec("m-2", 0.02, 10 * MB))
    cfg = SimConfig(model="m", stages=stages, slo_s=0.5, calibration=Calibration(hosts=2, gpus_per_host=8),
                    max_replicas=6, drain_s=0.0, seed=1)
    rng = np.random.default_rng(0)
    times = np.sort(np.concatenate([rng.uniform(0, 8, 40), rng.uniform(8, 12, 160)]))  # 5 → 40 req/s
    sim = Simulation(cfg, make_policy("quart", mode=mode), Arrivals(times, np.full(len(times), 64, dtype=np.int64)))
    sim.run()
    return sim


async def _live_twin(sim: Simulation, tmp_path):
    """The embedded gateway holding the same functions, labels, replica counts and start-time estimate."""
    hosts = [FakeHost("a", 16), FakeHost("b", 16)]
    gw = make(tmp_path, hosts)
    for st in sim.stages:
        body = {labels.MODEL: "m", labels.STAGE: str(st.index), labels.SCALE_MIN: str(sim.cfg.min_replicas),
                labels.SCALE_MAX: str(sim.max_replicas), labels.PARAM_BYTES: str(st.spec.param_bytes),
                labels.PROFILE_MS: f"{st.spec.service_s * 1000:g}"}


        await gw.deploy(FunctionDeployment.from_json({"service": st.function, "image": "quart/echo", "labels": body,
                                                      "limits": {"cpu": f"{st.cpus:g}"}}, "openfaas-fn"))
        await gw.scale(st.function, len(st.ready))
    await settle(gw)
    for host in hosts:
        host.make_ready()
    await settle(gw)
    for st in sim.stages:
        await gw.scale(st.function, st.desired)
        gw.functions[st.function].start_time = StartTimeEstimate(st.start_time.seconds)
    await settle(gw)
    return gw, hosts


def test_simulator_steps_the_live_controller() -> None:
    sim = _burst_sim()
    assert type(sim.controller) is Controller
    assert sim.key_counts, "the burst made QUART name a key stage"
    assert any(d.replicas > 1 for d in drive(sim.controller.step())["m"].stages)


@pytest.mark.parametrize("mode", ["pid", "provision"])
def test_simulated_and_live_steps_take_the_same_actions(tmp_path, mode) -> None:
    sim = _burst_sim(mode)
    live_policy = copy.deepcopy(sim.controller.policy("m"))  # the same policy state on both sides

    async def live_step():
        gw, hosts = await _live_twin(sim, tmp_path)
        try:
            view = GatewayView(gw)
            for st in sim.stages:  # the same platform state before the step
                state, simulated = view.stage_state(st.function), sim.stage_state(st.function)
                assert state == simulated, st.function
            recorder = Recorder(GatewayActuator(gw))
            ctl = Controller(view, sim, sim.collector, recorder, lambda: live_policy, sim.controller.config,
                             slo_s={"m": sim.cfg.slo_s}, clock=lambda: sim.now, keep_timeline=False)
            await ctl.step()
            await settle(gw)
            return ctl.last_snapshots["m"], recorder.calls, {f: gw.functions[f].desired for f in sim.functions}
        finally:
            await gw.close()

    before = {st.function: len(st.current()) for st in sim.stages}
    live_snap, live_calls, live_desired = asyncio.run(live_step())

    sim_recorder = Recorder(sim.controller.actuator)
    sim.controller.actuator = sim_recorder
    drive(sim.controller.step())
    sim._converge(sim.now)

    assert sim.controller.last_snapshots["m"] == live_snap
    assert sim_recorder.calls == live_calls, (sim_recorder.calls, live_calls)
    if mode == "pid":  # the PID corrector is still scaling up at this point; the provisioner did so earlier
        assert any(call[0] == "scale" and call[3] for call in live_calls), "a key-stage scale-up was decided"
    assert {st.function: st.desired for st in sim.stages} == live_desired
    asked = {st.function: len(st.current()) - before[st.function] for st in sim.stages}
    assert all(asked[f] == max(0, live_desired[f] - before[f]) for f in asked)


class _R:
    def __init__(self, name: str, state: str, in_flight: int, started_at: float) -> None:
        self.name, self.state, self.in_flight, self.started_at = name, state, in_flight, started_at


@pytest.mark.parametrize("desired,expected", [(4, []), (3, ["new"]), (2, ["new", "idle"]),
                                              (1, ["new", "idle", "busy1"])])
def test_surplus_stops_starting_then_idle_then_least_busy(desired: int, expected: list[str]) -> None:
    replicas = [_R("busy2", "ready", 2, 1.0), _R("idle", "ready", 0, 2.0), _R("new", "starting", 0, 3.0),
                _R("busy1", "ready", 1, 0.5)]
    assert [r.name for r in choose_surplus(replicas, desired)] == expected


def test_start_time_estimate_is_a_moving_average() -> None:
    est = StartTimeEstimate()
    assert est.seconds < 0
    assert est.note(1.0) == 1.0
    assert est.note(2.0) == pytest.approx(1.3)
