"""QUART's replica corrector (§5.1, Algorithm 1 `Correct`) with the fixes a real controller needs.

Sign convention: e(t) = (T_i(t) − T_target) / T_target, Δr = K_p·e + K_i·∫e dt + K_d·de/dt, r' = r + Δr.
A stage slower than its target (e > 0) gains replicas (the paper's e = T_target − T_i with r + Δr
would remove them). Added: integral clamp and conditional integration (anti-windup), a low-pass
filtered derivative, rounding of Δr, [r_min, r_max], a scale-down cooldown, and a floor of enough
replicas for ρ ≤ rho_max at all times (a scale-down never goes below it, nor below the count whose
M/M/c delay still meets the target; without this the corrector shrank a stage into ρ > 1 and the
queue exploded, docs/simulator.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway_plugin.config import CorrectConfig
from gateway_plugin.policies.batch_capacity import capacity_rate, delay_s, service_rate_at, work_s
from gateway_plugin.policies.queueing import servers_for_utilisation
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot
from quart_kernel.replicaset import StartTimeEstimate


def stage_target_s(snapshot: PipelineSnapshot, stage: StageSnapshot, default_factor: float) -> float:
    """The stage's delay target: its own if set, else the SLO split by service time, else factor × service."""
    if stage.target_s > 0:
        return stage.target_s
    service = work_s(stage)  # a batching stage: S(1), not the mean call its requests report
    if snapshot.slo_s > 0:
        total = sum(work_s(s) for s in snapshot.stages)
        if total > 0 and service > 0:
            return snapshot.slo_s * service / total
        return snapshot.slo_s / max(1, len(snapshot.stages))
    return default_factor * service if service > 0 else math.inf


def servers_of(stage: StageSnapshot, replicas: int) -> int:
    """Parallel servers of ``replicas`` replicas (each serves ``concurrency`` requests at once)."""
    return replicas * max(1, stage.concurrency)


def stability_floor(stage: StageSnapshot, rho_max: float, target_s: float = math.inf) -> int:
    """Fewest replicas that keep ρ ≤ rho_max at the larger of the window's and the last second's λ (a batching
    stage: at the batches that fit ``target_s``, batch_capacity.capacity_rate)."""
    if stage.service_rate <= 0:
        return 0
    rate = max(stage.arrival_rate, stage.recent_rate)
    return math.ceil(servers_for_utilisation(rate, capacity_rate(stage, target_s), rho_max) / max(1, stage.concurrency))


def estimated_delay_s(
    stage: StageSnapshot, replicas: int, use_queue_feedback: bool, min_backlog_s: float = 0.0,
    peak_rate: bool = False,
) -> float:
    """T_i: M/M/c delay at the measured λ, μ, raised by what the queue shows now (backlog and wait).

    The queue terms count only when the backlog needs at least ``min_backlog_s`` to drain: a burst that
    is gone before a new replica could start is no reason to add one (dead-time gate).
    """
    if stage.service_rate <= 0:
        return 0.0  # nothing measured yet: no evidence of delay
    servers = servers_of(stage, replicas)
    rate = max(stage.arrival_rate, stage.recent_rate) if peak_rate else stage.arrival_rate
    t = delay_s(stage, rate, servers)  # M/M/c, or its batched form (batch_capacity)
    if use_queue_feedback and servers > 0:
        drain_s = stage.queue_len / (servers * service_rate_at(stage, rate, servers))
        if drain_s >= min_backlog_s:
            observed = stage.mean_wait_s + stage.mean_service_s if stage.queue_len > 0 else 0.0
            t = max(t, drain_s + stage.mean_service_s, observed)
    return t


@dataclass(slots=True)
class _PIDState:
    integral: float = 0.0
    last_error: float | None = None
    last_time: float | None = None
    derivative: float = 0.0
    last_scale_up: float = -math.inf
    pending_since: float | None = None  # when replicas were first seen pending (start-time learning)
    ready_then: int = 0
    start_time: StartTimeEstimate | None = None  # learned ask → ready time, when the platform measures none


@dataclass(frozen=True, slots=True)
class Correction:
    """What the corrector decided for one stage."""

    replicas: int
    delay_s: float  # T_i at the current replicas
    target_s: float
    error: float  # relative error used by the PID
    scaled_up: bool
    reason: str


@dataclass(slots=True)
class Corrector:
    """Per-stage PID on the relative delay error; state is kept per stage index."""

    config: CorrectConfig = field(default_factory=CorrectConfig)
    _state: dict[int, _PIDState] = field(default_factory=dict)

    def correct(self, snapshot: PipelineSnapshot, stage: StageSnapshot, release_idle: bool = False) -> Correction:
        """``release_idle``: another stage is starved of replicas (see ``starved``), so an idle stage in its
        cooldown may give back what it does not need now instead of holding it for the cooldown."""
        cfg = self.config
        st = self._state.setdefault(stage.index, _PIDState())
        now = snapshot.time
        current = stage.replicas + stage.pending_replicas
        self._learn_start_time(st, stage, now)
        target = stage_target_s(snapshot, stage, cfg.default_target_factor)
        gate = self.dead_time_s(stage) if cfg.dead_time_gate else 0.0
        delay = estimated_delay_s(stage, max(current, 0), cfg.use_queue_feedback, gate, cfg.peak_rate)
        if stage.service_rate <= 0 or not math.isfinite(target) or target <= 0:
            error = 0.0  # no service time measured yet: no evidence either way
        elif math.isinf(delay):
            error = cfg.error_cap
        else:
            error = max(-1.0, min(cfg.error_cap, (delay - target) / target))

        dt = 0.0 if st.last_time is None else max(0.0, now - st.last_time)
        if st.last_error is not None and dt > 0:
            raw_derivative = (error - st.last_error) / dt
            st.derivative += cfg.derivative_alpha * (raw_derivative - st.derivative)
        proposed_integral = max(-cfg.integral_limit, min(cfg.integral_limit, st.integral + error * dt))

        delta = cfg.kp * error + cfg.ki * proposed_integral + cfg.kd * st.derivative
        step = math.ceil(delta - 1e-9) if delta > 0 else -math.floor(-delta + 1e-9) if delta < 0 else 0
        if error > 0 and step <= 0:
            step = 1  # too slow: never hold still or shrink
        if error <= 0 and step > 0:
            step = 0  # fast enough: never grow on integral memory alone
        desired = current + step
        reason = f"T={_fmt(delay)}s target={_fmt(target)}s e={error:+.2f}"

        floor = max(stage.min_replicas, stability_floor(stage, cfg.rho_max, target))
        if stage.service_rate > 0 and stage.recent_rate >= servers_of(stage, current) * capacity_rate(stage):
            desired = max(desired, floor + max(0, step))
            reason += " rho>=1"
        floor = min(floor, stage.max_replicas)
        desired = max(floor, min(stage.max_replicas, desired))
        if desired < current and stage.service_rate > 0 and math.isfinite(target):
            # Scale down only to a count that still meets the target at the measured load.
            while desired < current and estimated_delay_s(stage, desired, cfg.use_queue_feedback, gate,
                                                          cfg.peak_rate) > target:
                desired += 1

        if desired < current:
            if release_idle and stage.queue_len == 0:
                reason += " (released: another stage waits for replicas)"
            elif now - st.last_scale_up < cfg.scale_down_cooldown_s:
                desired = current
                reason += " (cooldown)"
            else:
                desired = max(desired, current - cfg.max_step_down)

        saturated = (desired >= stage.max_replicas and error > 0) or (desired <= stage.min_replicas and error < 0)
        if not saturated:
            st.integral = proposed_integral  # conditional integration: no windup against a limit
        scaled_up = desired > current
        if scaled_up:
            st.last_scale_up = now
        st.last_error, st.last_time = error, now
        return Correction(desired, delay, target, error, scaled_up, reason)

    def observe_start(self, stage: StageSnapshot, now: float) -> None:
        """Learn the start time from a snapshot without correcting (the provisioning mode's use)."""
        self._learn_start_time(self._state.setdefault(stage.index, _PIDState()), stage, now)

    def _learn_start_time(self, st: _PIDState, stage: StageSnapshot, now: float) -> None:
        """Observe how long asked-for replicas take to become ready (the loop's dead time)."""
        if stage.pending_replicas > 0 and st.pending_since is None:
            st.pending_since, st.ready_then = now, stage.replicas
        elif st.pending_since is not None and (stage.replicas > st.ready_then or stage.pending_replicas == 0):
            if stage.replicas > st.ready_then:
                if st.start_time is None:
                    st.start_time = StartTimeEstimate(alpha=self.config.start_time_alpha)
                st.start_time.note(now - st.pending_since)
            st.pending_since = now if stage.pending_replicas > 0 else None
            st.ready_then = stage.replicas

    def dead_time_s(self, stage: StageSnapshot) -> float:
        """How long a replica asked for now takes to serve: the platform's measurement when the snapshot has one
        (the embedded gateway times every ask → ready), else what this corrector learned from its snapshots
        (resolution: one control period), else the configured default."""
        return stage.replica_start_s if stage.replica_start_s >= 0 else self.replica_start_s(stage.index)

    def starved(self, stage: StageSnapshot, now: float) -> bool:
        """The stage has waited for asked-for replicas much longer than a start takes: the cluster has no room
        (the platform keeps the ask pending until a slot frees)."""
        st = self._state.get(stage.index)
        if st is None or st.pending_since is None or stage.pending_replicas <= 0:
            return False
        return now - st.pending_since > max(self.config.starved_after_s, 3 * self.dead_time_s(stage))

    def start_known(self, stage: StageSnapshot) -> bool:
        """A start time was measured (by the platform or from this corrector's snapshots), not just configured."""
        st = self._state.get(stage.index)
        return stage.replica_start_s >= 0 or (st is not None and st.start_time is not None)

    def replica_start_s(self, index: int) -> float:
        """Learned time from asking for a replica to its being ready (config default until observed)."""
        st = self._state.get(index)
        return st.start_time.seconds if st is not None and st.start_time is not None else self.config.replica_start_s

    def last_scale_up(self, index: int) -> float:
        """Time the stage last scaled up (−inf if never)."""
        st = self._state.get(index)
        return st.last_scale_up if st else -math.inf

    def note_scale_up(self, index: int, time: float) -> None:
        """Another component raised the stage: restart its cooldown."""
        self._state.setdefault(index, _PIDState()).last_scale_up = time


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3f}"
