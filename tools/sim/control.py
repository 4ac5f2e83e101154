"""The control side of the simulator: the live controller over the simulated platform, then the one convergence.

Every ``control_period_s`` the live `gateway_plugin.controller.Controller` decides over this simulated platform
(this class is the controller's Inventory and QueueView; `Controller.decide` is synchronous, its changes are
applied here as the embedded gateway's registry applies them): the same snapshot builder over the live
sliding-window metrics, the same policy, the same bounds (`replicaset.within_bounds`). What follows a decision
is the live reconciler's one convergence (`quart_kernel.convergence.converge`) over this platform's view
(functions, replicas, ParaServe groups, hosts): the shortfall goes to the placer, each placement starts by the
live start rule (`plan_starts`), the surplus choice stops the same replicas, a rolling update retires the
previous generation. A CPU change re-forks the stage's replicas from its cached zygotes; the ask → ready estimate is the same
moving average.
"""

from __future__ import annotations

from gateway_plugin.config import PluginConfig
from gateway_plugin.controller import Change, Controller
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.snapshot_builder import StageState
from quart_kernel.convergence import Convergence, FunctionView, PlatformView, ReplicaView, converge
from quart_kernel.replicaset import note_key_scale, within_bounds
from quart_kernel.scheduling import Placer
from quart_kernel.scheduling.paraserve_groups import consolidating
from quart_tools.report import StageSample
from quart_tools.sim.batching import profile_s
from quart_tools.sim.cluster import Host
from quart_tools.sim.events import KICK, RECONCILE, EventLoop
from quart_tools.sim.starting import ReplicaStarts
from quart_tools.sim.state import SimConfig, Tally, _Stage


class SimActuator:
    """The controller's actuator on the simulated platform (for `Controller.step`; the run itself applies
    `Controller.decide`'s changes directly, on simulated time)."""

    def __init__(self, control: ControlLoop) -> None:
        self.control = control

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        self.control.scale(function, replicas, key)

    async def set_cpus(self, function: str, cpus: float) -> None:
        self.control.set_cpus(function, cpus)


class ControlLoop:
    """The controller's view of the simulated platform, its decisions applied, and the convergence carried out."""

    def __init__(self, cfg: SimConfig, policy, stages: list[_Stage], hosts: list[Host], loop: EventLoop,
                 tally: Tally, starts: ReplicaStarts, placer: Placer) -> None:
        self.cfg, self.stages, self.hosts, self.loop, self.tally, self.starts, self.placer = \
            cfg, stages, hosts, loop, tally, starts, placer
        cal = cfg.calibration
        self.functions = [st.function for st in stages]
        self.stage_by_fn = {st.function: st for st in stages}
        self.max_replicas = cfg.max_replicas or max(1, 2 * cal.hosts * cal.gpus_per_host // len(stages))
        self.key_history: dict[str, int] = {}  # the gateway's count of key-stage scale-ups per function
        self.reconcile_due = False
        self.collector = MetricsCollector(cfg.window_s)
        self.collector.stages.update({st.function: st.metrics for st in stages})
        plugin = PluginConfig(queue_cap=cfg.queue_cap, window_s=cfg.window_s, control_period_s=cfg.control_period_s,
                              slo_factor=cfg.slo_factor, tpot_slo_ms=1000 * cfg.tpot_slo_s, kick=cfg.kick)
        self.controller = Controller(self, self, self.collector, SimActuator(self), lambda: policy, plugin,
                                     slo_s={cfg.model: cfg.slo_s}, clock=lambda: loop.now, keep_timeline=False)
        # a kicked decision runs at the arrival's time, after it (an event), as the live loop wakes after it
        self.controller.on_kick = lambda now: loop.push(now, KICK, None)

    # Inventory and QueueView (gateway_plugin.snapshot_builder) of the simulated platform and router.
    def pipelines(self) -> dict[str, list[str]]:
        return {self.cfg.model: list(self.functions)}

    def stage_state(self, function: str) -> StageState:
        st = self.stage_by_fn[function]
        return StageState(ready=len(st.ready), desired=st.desired, cpus=st.cpus,
                          min_replicas=self.cfg.min_replicas, max_replicas=self.max_replicas, concurrency=1,
                          param_bytes=st.spec.param_bytes,
                          profiled_service_s=st.spec.service_s if self.cfg.profile_label else 0.0,
                          start_s=st.start_time.seconds, batch_max=self.cfg.batch_max,
                          batch_profile_s=profile_s(st.spec.service_s, self.cfg.batch_max, self.cfg.batch_fixed)
                          if self.cfg.batch_max > 1 and self.cfg.profile_label else ())

    def queue_len(self, function: str) -> int:
        st = self.stage_by_fn[function]
        return len(st.queue) + len(st.remainders) + st.waiting

    def busy(self, function: str) -> int:
        return self.stage_by_fn[function].busy

    # ------------------------------------------------------------------------------ decide
    def step(self, now: float, kicked: bool = False) -> None:
        """One step of the live controller (a period's, or one traffic kicked); then the platform converges, as the
        gateway's kicked reconcile."""
        tally = self.tally
        if self.cfg.record_series and not kicked:  # the series stays one sample per period
            for st in self.stages:
                tally.samples.append(StageSample(now, st.index, len(st.ready) + len(st.starting), len(st.queue)))
        decisions, changes = self.controller.decide(kicked)
        self.apply(changes)
        decision = decisions[self.cfg.model]
        if decision.key_stages:
            tally.decisions.append((now, tuple(sorted(decision.key_stages))))
            for i in decision.key_stages:
                tally.key_counts[i] = tally.key_counts.get(i, 0) + 1
        self.converge(now)

    def apply(self, changes: list[Change]) -> None:
        """The controller's changes, as the embedded gateway applies them (`EmbeddedGateway.scale`, `.update_limits`)."""
        for change in changes:
            if change.replicas is not None:
                self.scale(change.function, change.replicas, change.key)
            if change.cpus is not None:
                self.set_cpus(change.function, change.cpus)

    def scale(self, function: str, replicas: int, key: bool = False) -> None:
        st = self.stage_by_fn[function]
        applied = within_bounds(replicas, self.max_replicas)  # the registry's rule (com.openfaas.scale.max)
        note_key_scale(self.key_history, function, st.desired, applied, key)
        st.desired = applied

    def set_cpus(self, function: str, cpus: float) -> None:
        """A CPU change is no rolling update: the stage's CPUs change, and the one convergence resizes its ready
        replicas in place (``resize`` actions, `quart_kernel.resize`; the live registry does the same)."""
        self.stage_by_fn[function].cpus = cpus

    # ---------------------------------------------------------------------------- converge
    def view(self, now: float) -> PlatformView:
        """This platform as the one convergence reads it (the live reconciler's `Reconciler.view`)."""
        functions = []
        for st in self.stages:
            current = st.current()
            protected = frozenset(str(r.id) for r in current if r.group is not None and consolidating(
                0, (m.consolidated_at >= 0 for m in r.group if m.state in ("starting", "ready"))))
            functions.append(FunctionView(
                st.function, st.desired, st.generation,
                tuple(ReplicaView(str(r.id), r.state, r.generation, r.in_flight, r.started_at, cpus=r.cpus)
                      for r in current),
                0, 0.0, protected, st.spec.param_bytes, st.function in self.key_history, len(st.ready), st.cpus))
        return PlatformView(now, tuple(functions), tuple(h.view() for h in self.hosts), dict(self.key_history),
                            self.cfg.start_mechanisms)

    def converge(self, now: float) -> Convergence:
        """The gateway's reconcile: the one convergence's actions, carried out on this platform."""
        starts = self.starts
        plan = converge(self.view(now), self.placer, starts.paraserve_parts)
        by_id = {str(r.id): r for st in self.stages for r in st.current()}
        for action in plan.actions:
            rep = by_id.get(action.replica) if action.replica else None
            if rep is not None and action.kind == "resize":
                starts.resize(rep, action.cpus, now)
            elif rep is not None:  # stop / drain / retire
                starts.stop(self.stage_by_fn[action.function], rep, now)
        if plan.schedule is not None:
            self._scale_up(plan, now)
        return plan

    def reconcile(self, now: float) -> None:
        """The gateway's periodic reconcile (a `RECONCILE` event): place what is still missing once a GPU has come
        free."""
        self.reconcile_due = False
        if any(h.gpu_used < h.gpus for h in self.hosts):
            self.converge(now)
        elif any(len([r for r in st.current() if r.generation == st.generation]) < st.desired
                 for st in self.stages):
            self.reconcile_due = True
            self.loop.push(now + self.cfg.reconcile_s, RECONCILE, None)

    def _scale_up(self, plan: Convergence, now: float) -> None:
        result = plan.schedule
        assert result is not None
        for host in self.hosts:  # keep_cached is binding, as the live gateway pins it on each KeysManager
            host.pinned = frozenset(f for f, h in result.keep_cached if h == host.name)
        host_by_name = self.starts.host_by_name
        for action in plan.starts:
            start = action.plan
            assert start is not None
            host = host_by_name[start.host]
            if host.gpu_used >= host.gpus:
                continue  # defensive: a placer must not overfill a host
            self.starts.launch(self.stage_by_fn[action.function], host, start.mode, now, start)
        if result.unplaced and not self.reconcile_due and self.cfg.reconcile_s > 0:
            self.reconcile_due = True
            self.loop.push(now + self.cfg.reconcile_s, RECONCILE, None)
