"""One path from decision to action: the simulator drives the live Controller, a simulated control step
takes the same actions as a live one (the embedded gateway behind the plugin's inventory) on the same state,
and the live reconciler and the simulator converge by the same function to the same actions — with a start
pending, a ParaServe group not consolidated and a live start in the case."""

from __future__ import annotations

import asyncio
import copy
import time

import numpy as np
import pytest
from gateway_plugin.actuators.gateway import GatewayActuator
from gateway_plugin.controller import Controller
from gateway_plugin.plugin import GatewayView
from gateway_plugin.policies import make_policy
from quart_kernel.convergence import Action, FunctionView, PlatformView, ReplicaView, converge
from quart_kernel.replicaset import StartTimeEstimate, choose_surplus
from quart_kernel.scheduling import MECHANISMS, SchedulerConfig, make_placer
from quart_kernel.scheduling.paraserve_groups import Group
from quart_kernel.scheduling.starts import StartPlan
from quart_kernel.scheduling.types import HostView
from quart_provider.deployment import FunctionDeployment
from quart_provider.hosts import ReplicaSpec, ReplicaStatus, Started
from quart_provider.types import Endpoint
from quart_stage import labels
from quart_tools.arrivals import Arrivals
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec
from support.fake_hosts import FakeHost, make, settle

from keysmanager.types import StartOrder

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
                labels.SCALE_MAX: str(sim.control.max_replicas), labels.PARAM_BYTES: str(st.spec.param_bytes),
                labels.PROFILE_MS: f"{st.spec.service_s * 1000:g}"}


        await gw.registry.deploy(FunctionDeployment.from_json({"service": st.function, "image": "quart/echo", "labels": body,
                                                      "limits": {"cpu": f"{st.cpus:g}"}}, "openfaas-fn"))
        await gw.registry.scale(st.function, len(st.ready))
    await settle(gw)
    for host in hosts:
        host.make_ready()
    await settle(gw)
    for st in sim.stages:
        await gw.registry.scale(st.function, st.desired)
        gw.functions[st.function].start_time = StartTimeEstimate(st.start_time.seconds)
    await settle(gw)
    return gw, hosts


def test_simulator_steps_the_live_controller() -> None:
    sim = _burst_sim()
    assert type(sim.control.controller) is Controller
    assert sim.tally.key_counts, "the burst made QUART name a key stage"
    decisions, _changes = sim.control.controller.decide()
    assert any(d.replicas > 1 for d in decisions["m"].stages)


@pytest.mark.parametrize("mode", ["pid", "provision"])
def test_simulated_and_live_steps_take_the_same_actions(tmp_path, mode) -> None:
    sim = _burst_sim(mode)
    live_policy = copy.deepcopy(sim.control.controller.policy("m"))  # the same policy state on both sides

    async def live_step():
        gw, hosts = await _live_twin(sim, tmp_path)
        try:
            view = GatewayView(gw)
            for st in sim.stages:  # the same platform state before the step
                state, simulated = view.stage_state(st.function), sim.control.stage_state(st.function)
                assert state == simulated, st.function
            recorder = Recorder(GatewayActuator(gw))
            ctl = Controller(view, sim.control, sim.control.collector, recorder, lambda: live_policy, sim.control.controller.config,
                             slo_s={"m": sim.cfg.slo_s}, clock=lambda: sim.now, keep_timeline=False)
            await ctl.step()
            await settle(gw)
            return ctl.last_snapshots["m"], recorder.calls, {f: gw.functions[f].desired for f in sim.control.functions}
        finally:
            await gw.close()

    before = {st.function: len(st.current()) for st in sim.stages}
    live_snap, live_calls, live_desired = asyncio.run(live_step())

    _decisions, changes = sim.control.controller.decide()
    sim.control.apply(changes)
    sim.control.converge(sim.now)
    sim_calls = []
    for change in changes:
        if change.replicas is not None:
            sim_calls.append(("scale", change.function, change.replicas, change.key))
        if change.cpus is not None:
            sim_calls.append(("cpus", change.function, change.cpus))

    assert sim.control.controller.last_snapshots["m"] == live_snap
    assert sim_calls == live_calls, (sim_calls, live_calls)
    if mode == "pid":  # the PID corrector is still scaling up at this point; the provisioner did so earlier
        assert any(call[0] == "scale" and call[3] for call in live_calls), "a key-stage scale-up was decided"
    assert {st.function: st.desired for st in sim.stages} == live_desired
    asked = {st.function: len(st.current()) - before[st.function] for st in sim.stages}
    assert all(asked[f] == max(0, live_desired[f] - before[f]) for f in asked)


class _R:
    def __init__(self, name: str, state: str, in_flight: int, started_at: float) -> None:
        self.name, self.state, self.in_flight, self.started_at = name, state, in_flight, started_at
        self.kv_tokens = 0


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


# ---------------------------------------------------------------- one convergence (quart_kernel.convergence)
STAGES = (StageSpec("m-0", 0.02, 10 * MB), StageSpec("m-1", 0.05, 40 * MB), StageSpec("m-2", 0.02, 10 * MB))


class MirrorHost:
    """A live host that reports what one simulated host holds (less the start the live side has pending)."""

    def __init__(self, sim_host, pending: dict[str, str]) -> None:
        self.sim_host, self.name, self.pending = sim_host, sim_host.name, pending
        self.started: list[tuple[str, dict]] = []
        self.stopped: list[str] = []
        self.n = 0

    async def report(self) -> HostView:
        view = self.sim_host.view()
        running = dict(view.running)
        for function, host in self.pending.items():  # a start not answered yet: no replica on the host yet
            if host == self.name:
                running[function] -= 1
                view = HostView(view.name, view.gpu_slots, view.gpu_used - 1, view.memory_limit, view.memory_used,
                                view.cached, {f: n for f, n in running.items() if n}, view.held)
        return view

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        self.started.append((spec.function, order))
        self.n += 1
        return Started([ReplicaStatus(f"{self.name}-{spec.function}-{self.n}", spec.function, self.name,
                                      "http://127.0.0.1:1/", "starting")], order.mode)

    async def replicas(self) -> list[ReplicaStatus]:
        return []

    async def stop(self, replica_id: str) -> None:
        self.stopped.append(replica_id)

    async def close(self) -> None:
        pass


def _case() -> tuple[Simulation, str]:
    """m-0: one ready replica and a start pending, 3 wanted; m-1: one ready replica and a ParaServe group of two
    still loading, 1 wanted; m-2: one ready replica, 2 wanted (the peer start goes live)."""
    cfg = SimConfig(model="m", stages=STAGES, slo_s=0.5, calibration=Calibration(hosts=4, gpus_per_host=2),
                    max_replicas=4, prewarm_hosts=0, start_mechanisms=frozenset(MECHANISMS), drain_s=0.0,
                    record_series=False)
    sim = Simulation(cfg, make_policy("quart"), Arrivals(np.zeros(0), np.zeros(0, dtype=np.int64)))
    st0, st1, _ = sim.stages
    pending_host = min((h for h in sim.hosts if h.gpu_used < h.gpus), key=lambda h: not h.is_cached("m-0"))
    sim.starts.launch(st0, pending_host, "fork", 0.0, StartPlan("m-0", pending_host.name, "fork"))
    free = [h for h in sim.hosts if h.gpu_used < h.gpus and not h.is_cached("m-1")][:2]
    group = tuple(h.name for h in free)
    for host in free:
        sim.starts.launch(st1, host, "paraserve", 0.0, StartPlan("m-1", host.name, "paraserve", group=group))
    for function, wanted in (("m-0", 3), ("m-1", 1), ("m-2", 2)):
        sim.control.scale(function, wanted)
    return sim, pending_host.name


def _shape(action: Action, host_of) -> tuple:
    return (*action.shape(), host_of(action.replica) if action.replica else "")


def test_live_and_simulated_convergence_take_the_same_actions(tmp_path) -> None:
    sim, pending_host = _case()
    pending_id = str(sim.stages[0].starting[0].id)

    async def live():
        hosts = [MirrorHost(h, {"m-0": pending_host}) for h in sim.hosts]
        gw = make(tmp_path, hosts, peer_fetch=True, live_scaling=True, paraserve=True)
        try:
            for st in sim.stages:
                body = {labels.MODEL: "m", labels.STAGE: str(st.index), labels.SCALE_MAX: str(sim.control.max_replicas)}
                fn = await gw.registry.deploy(FunctionDeployment.from_json({"service": st.function, "image": "quart/echo",
                                                                   "labels": body, "limits": {"cpu": f"{st.cpus:g}"}},
                                                                  "openfaas-fn"))
                gw.reconciler._param_bytes[st.function] = (fn.generation, st.spec.param_bytes)
                for rep in st.current():
                    if str(rep.id) == pending_id:
                        continue  # live: asked of the host, not answered yet
                    whole = rep.group is None
                    fn.replicas[str(rep.id)] = Endpoint(str(rep.id), st.function, rep.host.name, "http://127.0.0.1:1/",
                                                        rep.state, rep.source, 1,
                                                        rep.requested_at, layers=(0, 4),
                                                        held=(0, 4) if whole else (0, 2), cpus=rep.cpus)
                fn.refresh_ready()
                await gw.registry.scale(st.function, st.desired)
            members = {str(r.id) for r in sim.stages[1].current() if r.group is not None}
            hosts_of_group = tuple(sorted({r.host.name for r in sim.stages[1].current() if r.group is not None}))
            gw.reconciler.paraserve.groups["m-1"] = [Group("m-1", hosts_of_group, [(0, 2), (2, 4)], members, 0)]
            gw.reconciler.work.run(asyncio.sleep(3600), "start", pending_host, "m-0")  # asked, not answered
            view = gw.reconciler.view(time.monotonic())
            await gw.reconciler._converge(time.monotonic())
            plan = gw.reconciler.last_convergence
            leaving = sum(1 for a in plan.actions if a.kind != "start")
            for _ in range(500):  # the start and stop tasks answer at once; bounded wait on a loaded machine
                if sum(len(h.started) for h in hosts) >= len(plan.starts) and \
                        sum(len(h.stopped) for h in hosts) >= leaving:
                    break
                await asyncio.sleep(0.01)
            new = {e.id: e for fn in gw.functions.values() for e in fn.replicas.values() if e.id.startswith("gpu-")}
            started = sorted((h.name, f, new[f"{h.name}-{f}-{i}"].partial_ok)  # partial_ok: routed while loading
                             for h in hosts for i, (f, _extra) in enumerate(h.started, start=1))
            stopped = sorted(r for h in hosts for r in h.stopped)  # drained (nothing in flight), then stopped
            return view, plan, started, stopped
        finally:
            await gw.close()

    live_view, live_plan, live_started, live_stopped = asyncio.run(live())
    host_of = {str(r.id): r.host.name for st in sim.stages for r in st.current()}.__getitem__
    sim_view = sim.control.view(sim.now)
    [m1_ready] = [str(r.id) for r in sim.stages[1].ready]
    sim_plan = sim.control.converge(sim.now)

    # the same platform, but for the start the live side has pending and the simulator has already started
    live_m0, sim_m0 = live_view.functions[0], sim_view.functions[0]
    assert (live_m0.pending_starts, len(live_m0.replicas)) == (1, 1) and len(sim_m0.replicas) == 2
    assert live_view.functions[1:] == sim_view.functions[1:]
    assert live_view.mechanisms == sim_view.mechanisms
    # the same actions
    assert [_shape(a, host_of) for a in live_plan.actions] == [_shape(a, host_of) for a in sim_plan.actions]
    kinds = {(a.kind, a.function, a.plan.mode if a.plan else "") for a in sim_plan.actions}
    assert ("start", "m-2", "live") in kinds, kinds  # a peer holds m-2 and a replica serves it: a live start
    assert ("start", "m-0", "") not in kinds and len([a for a in sim_plan.starts if a.function == "m-0"]) == 1
    stopped = [a for a in sim_plan.actions if a.kind in ("stop", "drain")]
    assert [(a.function, a.replica) for a in stopped] == [("m-1", m1_ready)]  # the group's members stay
    group = {str(r.id) for r in sim.tally.launched if r.group is not None}
    assert not group & {a.replica for a in stopped}, "a ParaServe group is never surplus before it consolidates"
    # and each side carried them out
    assert live_stopped == sorted(a.replica for a in stopped)
    # a live start is routed while it loads; the others once whole
    assert live_started == sorted((a.plan.host, a.function, a.plan.mode == "live") for a in sim_plan.starts)


def test_backoff_and_pending_starts_hold_new_starts() -> None:
    host = HostView("h", 4, 0, 1 << 30, 0)
    placer = make_placer("cache-aware", SchedulerConfig())
    ready = (ReplicaView("a", "ready", 1),)
    fn = FunctionView("f", 3, 1, ready, pending_starts=1)
    assert [a.kind for a in converge(PlatformView(10.0, (fn,), (host,)), placer).actions] == ["start"]
    backing_off = FunctionView("f", 3, 1, ready, retry_at=12.0)
    assert converge(PlatformView(10.0, (backing_off,), (host,)), placer).actions == ()
    assert len(converge(PlatformView(12.0, (backing_off,), (host,)), placer).starts) == 2


def test_surplus_drains_busy_stops_idle_and_rollover_retires() -> None:
    placer = make_placer("first-fit", SchedulerConfig())
    replicas = (ReplicaView("old", "ready", 1, 0, 0.0), ReplicaView("busy", "ready", 2, 2, 1.0),
                ReplicaView("idle", "ready", 2, 0, 2.0), ReplicaView("new", "starting", 2, 0, 3.0))

    def acts(fn: FunctionView) -> list[tuple[str, str]]:
        return [(a.kind, a.replica) for a in converge(PlatformView(0.0, (fn,)), placer).actions]

    assert acts(FunctionView("f", 1, 2, replicas)) == [("stop", "new"), ("stop", "idle"), ("retire", "old")]
    assert acts(FunctionView("f", 3, 2, replicas[:2] + replicas[3:])) == []  # one of 3 ready: no rollover yet
    assert acts(FunctionView("f", 0, 2, replicas[1:3])) == [("stop", "idle"), ("drain", "busy")]
    assert acts(FunctionView("f", 0, 2, replicas[1:3], protected=frozenset({"busy"}))) == [("stop", "idle")]


def test_surplus_prefers_replicas_without_sessions_and_drains_one_with() -> None:
    placer = make_placer("first-fit", SchedulerConfig())
    replicas = (ReplicaView("sessions", "ready", 1, 0, 0.0, kv_tokens=64),
                ReplicaView("busy", "ready", 1, 3, 1.0),
                ReplicaView("fewer", "ready", 1, 0, 2.0, kv_tokens=16))

    def acts(desired: int) -> list[tuple[str, str]]:
        fn = FunctionView("f", desired, 1, replicas)
        return [(a.kind, a.replica) for a in converge(PlatformView(0.0, (fn,)), placer).actions]

    assert acts(2) == [("drain", "busy")]  # requests in flight end; sessions would have to move
    assert acts(1) == [("drain", "busy"), ("drain", "fewer")]  # then the fewest booked positions
    assert acts(0)[-1] == ("drain", "sessions")  # a replica holding sessions is drained, never cut off
