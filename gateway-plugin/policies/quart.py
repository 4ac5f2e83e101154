"""The QUART policy: Correct → Smooth → CPU compensation (Algorithm 1), plus the key-stage list.

1. Correct (§5.1) gives every stage its demand ŷ_i (PID on the Erlang-C delay error).
2. Smooth (§5.2) proposes to reclaim replicas from a stage whose traffic is smooth relative to its
   neighbours (CV̂ from the propagation model, or the observed CV until a model is trained).
3. CPU compensation (§5.3, AllocateCPU): a reclaim is kept only if the stage still meets its delay target
   with fewer replicas, at its current CPUs or with the fewest extra CPUs the regression says suffice
   (≤ CPU_max). Otherwise Correct's ŷ_i stands (the paper's "SLO may be violated → Correct"). With
   ``CPUConfig.allocate`` (off by default: docs/policies.md) every other
   stage whose predicted delay is above the target although Correct adds no replica (its maximum reached, the
   cluster full) and none is starting (the bridge has those) gets the
   fewest CPUs that meet it, or CPU_max; a stage whose delay at
   ``cpu_default`` CPUs is ≤ ``release_margin`` × the target goes back to them, at most once per ``hold_s``. The
   bridge (``CPUConfig.bridge``, on; gateway_plugin.policies.cpu_bridge): while a stage has fewer ready replicas than
   decided (its new ones start), the ready ones get the CPUs that carry the decided capacity, back to
   ``cpu_default`` once they serve. A CPU change is an in-place resize (quart_kernel.resize). A stage's service time
   at c CPUs is its *measured* time × the regression's ratio t(c)/t(now) (gateway_plugin.policies.cpu_model).
Stages Correct scaled up are the key stages; their history (count of decisions in which each stage
was key) goes to the scheduler. Pure: no I/O, time from the snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gateway_plugin.config import QuartConfig
from gateway_plugin.policies.batch_capacity import capacity_rate
from gateway_plugin.policies.correct import (
    Correction,
    Corrector,
    estimated_delay_s,
    servers_of,
    stage_target_s,
)
from gateway_plugin.policies.cpu_bridge import MIN_GAIN, bridge_cpus, cpu_steps
from gateway_plugin.policies.cpu_model import CPULatencyModel
from gateway_plugin.policies.provision import Provisioner
from gateway_plugin.policies.queueing import servers_for_utilisation
from gateway_plugin.policies.smooth import beta, reclaim_target
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision, StageSnapshot


@dataclass(slots=True)
class QuartPolicy:
    config: QuartConfig = field(default_factory=QuartConfig)
    cv_model: object | None = None  # a trained CVPropagationModel (gateway_plugin.policies.cv_model)
    cpu_model: CPULatencyModel | None = None
    name: str = "quart"
    corrector: Corrector = field(init=False)
    provisioner: Provisioner | None = field(init=False)
    cpu_changed_at: dict[int, float] = field(init=False, default_factory=dict)  # stage → time of its last CPU change
    bridged: set[int] = field(init=False, default_factory=set)  # stages whose CPUs the bridge raised

    def __post_init__(self) -> None:
        if self.config.mode not in ("provision", "pid"):
            raise ValueError(f"QuartConfig.mode must be 'provision' or 'pid', got {self.config.mode!r}")
        self.corrector = Corrector(self.config.correct)
        self.provisioner = Provisioner(self.config.provision, self.config.correct) if self.config.mode == "provision" else None

    def predicted_cv(self, snapshot: PipelineSnapshot) -> list[float]:
        if self.cv_model is not None:
            return list(self.cv_model.predict(snapshot))  # type: ignore[attr-defined]
        return [s.cv_arrival for s in snapshot.stages]

    def decide(self, snapshot: PipelineSnapshot) -> Decision:
        cfg = self.config
        release = cfg.correct.release_when_starved and any(self.corrector.starved(s, snapshot.time)
                                                             for s in snapshot.stages)
        if self.provisioner is not None:
            for s in snapshot.stages:
                self.corrector.observe_start(s, snapshot.time)
            starts = [self.corrector.dead_time_s(s) for s in snapshot.stages]
            # a cluster is full only if asks wait far longer than a *measured* start: before the first start
            # completes (a cold start of tens of seconds) waiting is no sign of a full cluster
            full = any(self.corrector.starved(s, snapshot.time) and self.corrector.start_known(s)
                       for s in snapshot.stages)
            corrections = self.provisioner.correct_all(snapshot, starts, full)
            for s, c in zip(snapshot.stages, corrections, strict=True):
                if c.scaled_up:
                    self.corrector.note_scale_up(s.index, snapshot.time)
            release = False
        else:
            corrections = [self.corrector.correct(snapshot, s, release) for s in snapshot.stages]
        if cfg.backlog_lookahead:
            corrections = self._lookahead(snapshot, corrections)
        demand = [c.replicas for c in corrections]
        cvs = self.predicted_cv(snapshot)
        decisions: list[StageDecision] = []
        for stage, corr, cv in zip(snapshot.stages, corrections, cvs, strict=True):
            replicas, cpus, reason = corr.replicas, stage.cpus, corr.reason
            enough_data = stage.arrival_rate * snapshot.window_s >= cfg.smooth.min_window_requests
            if cfg.smooth.enabled and not corr.scaled_up and enough_data:
                b = beta(cv, cfg.smooth)
                busy_replicas = math.ceil(stage.busy / max(1, stage.concurrency))
                keep = reclaim_target(demand, stage.index, b, stage.min_replicas, busy_replicas)
                cooling = snapshot.time - self.corrector.last_scale_up(stage.index)
                released = release and stage.queue_len == 0
                if keep < replicas and (cooling >= cfg.correct.scale_down_cooldown_s or released):
                    keep = max(keep, replicas - cfg.correct.max_step_down)
                    for candidate in range(keep, replicas):  # fewest replicas that still meet the target
                        new_cpus = self._compensate(stage, candidate, corr.target_s)
                        if new_cpus is not None:
                            reason += f" smooth cv={cv:.2f} beta={b:.2f} {replicas}->{candidate}"
                            if new_cpus != cpus:
                                reason += f" cpus {cpus:g}->{new_cpus:g}"
                            replicas, cpus = candidate, new_cpus
                            break
            if cpus == stage.cpus:
                cpus, reason = self._bridge(stage, replicas, cpus, reason)
            steady = stage.pending_replicas == 0 and replicas <= stage.replicas  # no start a CPU roll would void
            if cpus == stage.cpus and steady and snapshot.time - self.cpu_changed_at.get(stage.index, -math.inf) >= cfg.cpu.hold_s:
                cpus, reason = self._allocate(stage, replicas, corr.target_s, cpus, reason)
            if cpus != stage.cpus:
                self.cpu_changed_at[stage.index] = snapshot.time
            decisions.append(StageDecision(replicas=replicas, cpus=cpus, reason=reason))
        key = tuple(c_i for c_i, corr in enumerate(corrections) if corr.scaled_up)
        return Decision(time=snapshot.time, stages=tuple(decisions), key_stages=key)

    def _lookahead(self, snapshot: PipelineSnapshot, corrections: list[Correction]) -> list[Correction]:
        """Raise stages downstream of a backlog to the rate it will be released at (see QuartConfig)."""
        rho_max = self.config.correct.rho_max
        out = list(corrections)
        backlog = 0  # requests queued or in service upstream of stage i: all of them come to stage i next
        release_rate = math.inf  # req/s they can reach stage i at: the slowest upstream stage at its new size
        for i, stage in enumerate(snapshot.stages):
            if i > 0:
                up = snapshot.stages[i - 1]
                backlog += up.queue_len + up.busy
                release_rate = min(release_rate, servers_of(up, out[i - 1].replicas) * capacity_rate(up))
            if backlog == 0 or not math.isfinite(release_rate) or release_rate <= 0 or stage.service_rate <= 0:
                continue
            if backlog / release_rate < self.corrector.dead_time_s(stage):
                continue  # gone before a new replica could serve
            mu = capacity_rate(stage, stage_target_s(snapshot, stage, self.config.correct.default_target_factor))
            need = math.ceil(servers_for_utilisation(release_rate, mu, rho_max) / max(1, stage.concurrency))
            need = min(need, stage.max_replicas)
            current = stage.replicas + stage.pending_replicas
            if need > out[i].replicas:
                if need > current:
                    self.corrector.note_scale_up(stage.index, snapshot.time)
                c = out[i]
                out[i] = replace(c, replicas=need, scaled_up=need > current,
                                 reason=c.reason + f" backlog {backlog} upstream at {release_rate:.0f}/s")
        return out

    def _delay_at(self, stage: StageSnapshot, replicas: int, cpus: float) -> float:
        """Predicted delay of ``stage`` at ``replicas`` replicas of ``cpus`` CPUs each."""
        cfg = self.config.correct
        gate = self.corrector.dead_time_s(stage) if cfg.dead_time_gate else 0.0
        if cpus != stage.cpus and self.cpu_model is not None and stage.service_rate > 0:
            stage = replace(stage, service_rate=stage.service_rate / self.cpu_model.service_ratio(stage.cpus, cpus))
        return estimated_delay_s(stage, replicas, cfg.use_queue_feedback, gate, cfg.peak_rate)

    def _cpu_steps(self, stage: StageSnapshot) -> list[float]:
        """CPU counts above the stage's current ones, in ``cpu_step`` steps up to CPU_max."""
        return cpu_steps(self.config.cpu, stage.cpus)

    def _bridge(self, stage: StageSnapshot, replicas: int, cpus: float, reason: str) -> tuple[float, str]:
        """CPUs of a stage whose new replicas start (`cpu_bridge.bridge_cpus`), back to ``cpu_default`` after."""
        cpu_cfg = self.config.cpu
        if not (cpu_cfg.enabled and cpu_cfg.bridge) or self.cpu_model is None:
            return cpus, reason
        new = bridge_cpus(stage.replicas, replicas, cpu_cfg, self.cpu_model.service_ratio)
        if new == cpu_cfg.cpu_default and stage.index not in self.bridged:
            return cpus, reason  # not bridging: CPUs Smooth or AllocateCPU gave stay
        if new > cpu_cfg.cpu_default:
            self.bridged.add(stage.index)
        else:
            self.bridged.discard(stage.index)
        if new != cpus:
            reason += f" bridge cpus {cpus:g}->{new:g} ({stage.replicas} of {replicas} ready)"
        return new, reason

    def _compensate(self, stage: StageSnapshot, replicas: int, target_s: float) -> float | None:
        """CPUs that let ``replicas`` replicas meet the target, or None (keep Correct's count)."""
        if self._delay_at(stage, replicas, stage.cpus) <= target_s:
            return stage.cpus
        if not self.config.cpu.enabled or self.cpu_model is None:
            return None
        return next((c for c in self._cpu_steps(stage) if self._delay_at(stage, replicas, c) <= target_s), None)

    def _allocate(self, stage: StageSnapshot, replicas: int, target_s: float, cpus: float, reason: str
                  ) -> tuple[float, str]:
        """AllocateCPU for a stage above its target at its decided count (or back to ``cpu_default``)."""
        cpu_cfg = self.config.cpu
        if not (cpu_cfg.enabled and cpu_cfg.allocate) or self.cpu_model is None or stage.service_rate <= 0:
            return cpus, reason
        if self._delay_at(stage, replicas, stage.cpus) > target_s:
            steps = self._cpu_steps(stage)
            helps = [c for c in steps if self.cpu_model.service_ratio(stage.cpus, c) < 1.0 - MIN_GAIN]
            if helps:
                new = next((c for c in helps if self._delay_at(stage, replicas, c) <= target_s), helps[-1])
                return new, reason + f" allocate cpus {stage.cpus:g}->{new:g}"
        elif (stage.cpus > cpu_cfg.cpu_default
              and self._delay_at(stage, replicas, cpu_cfg.cpu_default) <= cpu_cfg.release_margin * target_s):
            return cpu_cfg.cpu_default, reason + f" cpus {stage.cpus:g}->{cpu_cfg.cpu_default:g} (target met)"
        return cpus, reason
