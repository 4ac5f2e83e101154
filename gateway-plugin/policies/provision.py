"""QUART's provisioning corrector (issue 15): size every stage for the pipeline's recent peak load and hold it.

Why (docs/benchmarks.md, "Equal cost"): at QUART's replica-seconds the clairvoyant oracle is within
0.83–1.00× of the best *constant* allocation, and its best schedules change every 5–15 s, never per
burst. The PID corrector spent the same replica-seconds reactively: it added replicas after a gamma
burst had queued (gone before a 0.9 s fork is ready), kept them through its cooldown, then shrank a
stage to the M/M/c minimum (ρ ≈ 0.8) where the next burst queued again, and it gave the entry stage
more than the rest (stage 0 averaged 6.6 replicas, stages 2–7 4.7–5.0 on BERT-21B CV 8). This
corrector spends the same budget the way the oracle does:

1. **Peak-rate sizing over a window**: λ̂_i = the largest mean arrival rate over ``rate_window_s``
   seen in the last ``peak_window_s``. Burstiness shows up as a higher peak, so the headroom grows
   with the CV without a queueing formula for it.
2. **Feed-forward** (backlog propagation in the steady state): every request visits every stage, so
   each stage is sized for max(its own λ̂, the entry stage's λ̂). A burst the entry stage sees is the
   next stages' load; stages of a balanced pipeline get equal counts.
3. **Servers**: the fewest c with the M/M/c delay at λ̂ within the stage's target, and ρ ≤ rho_max.
4. **Backlog** (dead-time gated): a queue that needs longer than ``backlog_starts`` × a replica's start
   time to drain at the current count gets the servers that drain it within that time.
5. **Hysteresis sized to the start cost**: up at once; down only once the demand has stayed below the
   current count, at most ``max_step_down`` per step, never below the replicas busy now. The reserve (the count
   then − the demand) is kept whole for ``hold_s`` = max(``hold_min_s``, ``hold_starts`` × the start time), then
   tapered off over (e − 1) × ``hold_s`` as fractional ski rental (``gateway_plugin.policies.keepalive``) against a
   burst that returns (``ski_rental_tail``; off: all of it at ``hold_s``).
6. **Start-up**: until a stage has seen traffic for ``peak_window_s``, its observed peak is the largest of
   fewer windows than the peak window holds (and, in the first seconds, a mean of a few bursty arrivals), so it
   is sized for at least the peak the full window is expected to show (``expected_peak_rate``), from the mean
   rate and the inter-arrival CV observed so far.

8–9. **Entry sizes the pipeline**, **long-run floor** (docs/policies.md numbering): gateway_plugin.policies.load_floor.

Pure: state is the policy's own (rate windows, timers); time comes from the snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from statistics import NormalDist

from gateway_plugin.config import CorrectConfig, ProvisionConfig
from gateway_plugin.policies.batch_capacity import capacity_rate, delay_s, work_s
from gateway_plugin.policies.correct import Correction, servers_of, stage_target_s
from gateway_plugin.policies.history import SampleWindow
from gateway_plugin.policies.keepalive import replicas_kept
from gateway_plugin.policies.load_floor import LoadFloor, sizing_rate
from gateway_plugin.policies.queueing import mmc_delay, servers_for_utilisation
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot


def servers_for_target(rate: float, service_rate: float, target_s: float, rho_max: float, limit: int,
                       delay_at: Callable[[int], float] | None = None) -> int:
    """Fewest servers (≤ limit) with ρ ≤ rho_max and the delay at ``rate`` within ``target_s``: the M/M/c delay,
    or ``delay_at(c)`` (a batching stage's, gateway_plugin.policies.batch_capacity)."""
    if rate <= 0 or service_rate <= 0:
        return 0
    c = servers_for_utilisation(rate, service_rate, rho_max)
    while c < limit and (delay_at(c) if delay_at else mmc_delay(rate, service_rate, c)) > target_s:
        c += 1
    return min(c, limit)


def burst_factor(cv: float, cap: float) -> float:
    """Allen–Cunneen's G/G/c factor on the M/M/c wait, (CV_a² + CV_s²)/2 with the arrivals' CV capped at ``cap``
    and CV_s = 1 (the M/M/c formula's own service law): 1 for Poisson arrivals or when off (``cap`` 0)."""
    if cap <= 0:
        return 1.0
    return max(1.0, (min(max(cv, 0.0), cap) ** 2 + 1.0) / 2)


def gg_delay_s(stage: StageSnapshot, rate: float, servers: int, factor: float) -> float:
    """T(λ, c) with the wait scaled by ``factor`` (``burst_factor``); the plain M/M/c delay at factor 1."""
    delay = delay_s(stage, rate, servers)
    if factor == 1.0 or not math.isfinite(delay):
        return delay
    service = delay_s(stage, 0.0, 1)  # no wait: the service time alone
    return service + factor * (delay - service)


def expected_peak_rate(mean_rate: float, cv: float, span_s: float, rate_window_s: float, peak_window_s: float) -> float:
    """The largest ``rate_window_s`` mean rate a ``peak_window_s`` window is expected to show, from the mean rate
    and the inter-arrival CV of a renewal process: its count over T seconds has variance λ·T·CV², so a T-second mean
    has σ = √(λ·CV²/T), and the largest of n = peak / rate windows is ≈ λ + z_n·σ (z_n: Blom's expected maximum of n
    standard normals). While less than ``rate_window_s`` is observed (``span_s``), σ is that of the span observed:
    the mean itself is that uncertain."""
    if mean_rate <= 0 or span_s <= 0:
        return 0.0
    n = max(1.0, peak_window_s / rate_window_s)
    z = NormalDist().inv_cdf((n - 0.375) / (n + 0.25))
    return mean_rate + max(0.0, z) * math.sqrt(mean_rate * max(cv, 0.0) ** 2 / min(span_s, rate_window_s))


RECENT_S = 1.0  # the snapshot's recent rate is λ over the last second (metrics.StageMetrics.recent_s)


@dataclass(slots=True)
class _StageState:
    rates: SampleWindow  # (time, λ over the last second)
    means: SampleWindow  # (time, mean λ over rate_window_s)
    below_since: float | None = None  # when the demand first fell below the current count
    since: float | None = None  # first snapshot with traffic
    last_scale_up: float = -math.inf
    arrived: float = 0.0  # requests seen since the first traffic (Σ λ over the last second × the step)
    span_s: float = 0.0  # seconds those requests came in
    cv: float = 1.0  # inter-arrival CV of the last snapshot
    floor: LoadFloor | None = None  # rule 9 (gateway_plugin.policies.load_floor)
    top: int = 0  # the count when the demand fell below it (the burst reserve is top − demand)


@dataclass(slots=True)
class Provisioner:
    """Per-stage demand from the windowed peak rate, with start-cost hysteresis (see the module doc)."""

    config: ProvisionConfig = field(default_factory=ProvisionConfig)
    correct: CorrectConfig = field(default_factory=CorrectConfig)
    _state: dict[int, _StageState] = field(default_factory=dict)
    capacity: int | None = None  # replicas the cluster held for this pipeline while a stage starved (learned)

    def _observe(self, stage: StageSnapshot, now: float) -> _StageState:
        cfg = self.config
        st = self._state.get(stage.index)
        if st is None:
            st = self._state[stage.index] = _StageState(SampleWindow(cfg.rate_window_s), SampleWindow(cfg.peak_window_s),
                                                        floor=LoadFloor(cfg.floor_horizon_s, cfg.floor_z))
        if st.since is None and stage.recent_rate <= 0 and stage.arrival_rate <= 0:
            return st  # no traffic yet: an idle start is no sample of the load
        if st.since is None:
            st.since = now
        if not st.rates.samples or now > st.rates.samples[-1][0]:
            step = min(RECENT_S, now - st.rates.samples[-1][0]) if st.rates.samples else RECENT_S
            st.arrived += max(0.0, stage.recent_rate) * step
            st.span_s += step
            st.cv = stage.cv_arrival
            st.rates.add(now, max(0.0, stage.recent_rate))
            st.means.add(now, st.rates.mean(cfg.rate_window_s))
            if st.floor is not None and st.span_s >= cfg.rate_window_s:  # whole windows only
                st.floor.add(now, st.means.samples[-1][1])
        return st

    def peak_rate(self, index: int) -> float:
        """λ̂ of a stage: the largest ``rate_window_s`` mean in the last ``peak_window_s`` (0 before any sample;
        samples start with the stage's first traffic, so an idle start does not dilute the first means)."""
        cfg = self.config
        st = self._state.get(index)
        if st is None:
            return 0.0
        observed = st.means.max(cfg.peak_window_s)
        if st.floor is not None:
            observed = max(observed, st.floor.rate())
        if not cfg.startup_estimate or st.span_s <= 0 or st.span_s >= cfg.peak_window_s:
            return observed
        expected = expected_peak_rate(st.arrived / st.span_s, st.cv, st.span_s, cfg.rate_window_s, cfg.peak_window_s)
        return max(observed, expected)

    def last_scale_up(self, index: int) -> float:
        st = self._state.get(index)
        return st.last_scale_up if st is not None else -math.inf

    def correct_all(self, snapshot: PipelineSnapshot, start_s: list[float], starved: bool = False) -> list[Correction]:
        """One Correction per stage; ``start_s[i]``: how long a replica asked for now takes to serve;
        ``starved``: some stage has waited far longer than a start for replicas the cluster cannot place."""
        now = snapshot.time
        for s in snapshot.stages:
            self._observe(s, now)
        first = snapshot.stages[0] if snapshot.stages else None
        entry = self.peak_rate(first.index) if first is not None else 0.0
        if not self.config.feed_forward:
            entry = 0.0
        out, released = [], 0.0
        for k, s in enumerate(snapshot.stages):
            corr, release = self._correct(snapshot, s, entry, released if self.config.propagate_backlog else 0.0,
                                          start_s[k])
            out.append(corr)
            released = max(released, release)
        if self.config.fair_share:
            held = sum(s.replicas for s in snapshot.stages)
            if starved:  # the cluster holds no more than this now (max over time: starting ones become ready)
                self.capacity = max(self.capacity or 0, held)
            if self.capacity is not None:
                capacity = held if starved else self.capacity
                shares = fair_shares(snapshot.stages, [c.replicas for c in out], capacity)
                out = [c if c.replicas <= cap else replace(c, replicas=cap, scaled_up=cap > s.replicas + s.pending_replicas,
                                                           reason=c.reason + f" (fair share {cap} of {capacity})")
                       for c, cap, s in zip(out, shares, snapshot.stages, strict=True)]
        return out

    def _correct(self, snapshot: PipelineSnapshot, stage: StageSnapshot, entry_rate: float, released: float,
                 start_s: float) -> tuple[Correction, float]:
        """The stage's correction and the rate its backlog will leave it at (0 without one worth a start);
        ``released``: the rate an upstream backlog arrives at (sized for at ρ ≤ rho_max while it lasts)."""
        cfg, now = self.config, snapshot.time
        st = self._state[stage.index]
        current = stage.replicas + stage.pending_replicas
        target = stage_target_s(snapshot, stage, self.correct.default_target_factor)
        first = stage.index == snapshot.stages[0].index
        rate = sizing_rate(self.peak_rate(stage.index), entry_rate, stage.arrival_rate, first, cfg.entry_sizes_pipeline)
        reason = f"peak={rate:.1f}/s"
        if stage.service_rate <= 0 or not math.isfinite(target) or target <= 0:
            return Correction(current, 0.0, target, 0.0, False, reason + " (no service time yet)"), 0.0
        per = max(1, stage.concurrency)
        bursty = burst_factor(st.cv, cfg.arrival_cv_cap)
        servers = servers_for_target(rate, capacity_rate(stage, target), target, self.correct.rho_max,
                                     stage.max_replicas * per, lambda c: gg_delay_s(stage, rate, c, bursty))
        if released > 0:
            upstream = servers_for_utilisation(released, capacity_rate(stage, target), self.correct.rho_max)
            if upstream > servers:
                servers, reason = upstream, reason + f" upstream backlog at {released:.0f}/s"
        release = 0.0
        drain_within = cfg.backlog_starts * max(start_s, 1e-3)
        mu = capacity_rate(stage, target)  # at the batches that fit the target
        if stage.queue_len > 0 and stage.queue_len / (max(1, servers_of(stage, current)) * mu) > drain_within:
            backlog = math.ceil((rate + stage.queue_len / drain_within) / mu - 1e-9)
            if backlog > servers:
                servers, reason = backlog, reason + f" backlog {stage.queue_len}"
                # it leaves at what this stage will serve once the replicas asked for now are ready: the next
                # stages' replicas, asked in the same step, are ready then too
                release = servers * mu
        demand = min(stage.max_replicas, max(stage.min_replicas, math.ceil(servers / per)))
        delay = delay_s(stage, rate, servers_of(stage, max(current, 0)))
        error = cfg_error(delay, target, self.correct.error_cap)
        if demand > current:
            st.below_since, st.last_scale_up = None, now
            return Correction(demand, delay, target, error, True, reason + f" {current}->{demand}"), release
        if demand == current:
            st.below_since = None
            return Correction(current, delay, target, error, False, reason), release
        if st.below_since is None:
            st.below_since, st.top = now, current
        hold = max(cfg.hold_min_s, cfg.hold_starts * start_s)
        idle = now - st.below_since
        if cfg.ski_rental_tail:  # hold, then taper as fractional ski rental (policies.keepalive)
            keep = replicas_kept(st.top, demand, idle, hold)
        else:
            keep = current if idle < hold else demand
        if keep >= current:
            return Correction(current, delay, target, error, False, reason + f" (hold {hold:.1f}s)"), release
        busy = math.ceil(stage.busy / per)
        down = max(keep, busy, current - self.correct.max_step_down)
        return Correction(down, delay, target, error, False, reason + f" {current}->{down}"), release


def floor_replicas(stage: StageSnapshot) -> int:
    """The fewest replicas a share may leave a stage: ``com.openfaas.scale.min`` and those busy now."""
    return max(stage.min_replicas, math.ceil(stage.busy / max(1, stage.concurrency)))


def fair_shares(stages: tuple[StageSnapshot, ...], demands: list[int], capacity: int) -> list[int]:
    """Replicas per stage when the stages together may hold ``capacity``: water-filling in proportion to
    service time (a pipeline serves at its slowest stage's capacity, so replicas one stage holds beyond its
    share only keep them from the stage that limits it); a stage that wants less than its share keeps its
    demand and the rest is shared again. Never below r_min nor the replicas busy now."""
    floors = [floor_replicas(s) for s in stages]
    if sum(demands) <= capacity:
        return list(demands)
    weights = {k: max(work_s(s) / max(1, s.concurrency), 1e-9) for k, s in enumerate(stages)}
    out = list(demands)
    left, open_ = float(capacity), set(weights)
    while open_:
        total = sum(weights[k] for k in open_)
        share = {k: left * weights[k] / total for k in open_}
        small = [k for k in open_ if demands[k] <= share[k]]
        if not small:  # largest remainder, so the shares add up to what is left; near-equal remainders go to the
            # stages that hold more now (stages of a balanced pipeline must not swap a replica every step)
            for k in open_:
                out[k] = math.floor(share[k] + 1e-9)
            spare = int(round(left)) - sum(out[k] for k in open_)
            order = sorted(open_, key=lambda k: (-round(share[k] - out[k], 1), -stages[k].replicas, k))
            for k in order[:max(0, spare)]:
                out[k] += 1
            break
        for k in small:
            left -= demands[k]
            open_.discard(k)
    return [max(f, min(d, o)) for f, d, o in zip(floors, demands, out, strict=True)]


def cfg_error(delay: float, target: float, cap: float) -> float:
    """Relative delay error (T − target)/target, capped (reported in the reason and the Correction)."""
    if math.isinf(delay):
        return cap
    return max(-1.0, min(cap, (delay - target) / target))
