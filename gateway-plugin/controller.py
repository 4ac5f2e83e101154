"""The control loop: every period, snapshot → policy → sessions' floor → bounds → desired {replicas, CPUs} → actuator.

The one path from a decision to an action, for every policy and for the simulator alike
(``quart_tools.sim`` calls :meth:`Controller.decide` over a simulated inventory and applies its changes on
simulated time; :meth:`Controller.step` hands them to the actuator): the policy decides, a generating stage is
raised to what its sessions need (``policies.decode_capacity``: KV room, decode steps within the TPOT target),
the stages computing on the CPU share the machine's cores (``policies.compute_budget``), ``bounded`` applies
``com.openfaas.scale.min/max`` once, and the actuator is told only what changed.
One policy object per pipeline (policies keep state). Scale-ups of the stages the policy names as
key stages are flagged ``key`` so the placer (the cache-aware scheduler behind the gateway's scale
call) prefers hosts that cache their parameters. Each step's snapshot and decision go to an
optional JSONL log (training data for the CV model) and to ``timeline`` (plots, reports).

Decisions come on the period's tick and, for every policy alike, when traffic kicks one (``gateway_plugin.kick``,
Knative's activator poke): the collector tells :meth:`Controller.note_arrival` of every arrival, and an arrival
that takes a stage's recent rate to ``kick_surge`` × what its last decision asked for asks for a decision now
(live: :meth:`run` wakes; the simulator pushes a kick event and calls :meth:`decide` at that time), at most one
per ``kick_min_interval_s``. Ticks stay on their period; a kicked decision is one more, marked in the timeline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import IO, Any

from gateway_plugin.actuators import Actuator
from gateway_plugin.config import PluginConfig
from gateway_plugin.kick import KickConfig, Kicker
from gateway_plugin.metrics import MetricsCollector, SnapshotGauges
from gateway_plugin.policies.compute_budget import within_compute
from gateway_plugin.policies.decode_capacity import with_session_floor
from gateway_plugin.ports import DecisionNotes
from gateway_plugin.snapshot import Decision, PipelineSnapshot, Policy, StageSnapshot
from gateway_plugin.snapshot_builder import GenerationView, Inventory, QueueView, build_snapshot
from gateway_plugin.zero import held_at_zero
from quart_kernel.replicaset import within_bounds

log = logging.getLogger("quart.controller")


def bounded_replicas(stage: StageSnapshot, replicas: int) -> int:
    """``replicas`` within the stage's ``com.openfaas.scale.min`` … ``max`` (the one bounds rule,
    `quart_kernel.replicaset.within_bounds`, which the registry applies to every desired count too)."""
    return within_bounds(replicas, stage.max_replicas, stage.min_replicas)


def bounded(snap: PipelineSnapshot, decision: Decision) -> Decision:
    """The decision with every stage's replicas within its bounds (reasons and CPUs kept)."""
    stages = tuple(replace(want, replicas=bounded_replicas(stage, want.replicas))
                   for stage, want in zip(snap.stages, decision.stages, strict=True))
    return replace(decision, stages=stages)


@dataclass(frozen=True, slots=True)
class Change:
    """What one decision asks of one function: a new desired count and/or CPUs (None: unchanged)."""

    function: str
    replicas: int | None = None
    key: bool = False  # a scale-up of a stage the policy named as a key stage
    cpus: float | None = None
    previous: int = 0  # the desired count it replaces (for the log)
    reason: str = ""  # the policy's why


@dataclass(slots=True)
class Controller:
    inventory: Inventory
    queues: QueueView
    collector: MetricsCollector
    actuator: Actuator
    policy_factory: Callable[[], Policy]
    config: PluginConfig = field(default_factory=PluginConfig)
    slo_s: Mapping[str, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    log_file: IO[str] | None = None
    keep_timeline: bool = True
    policies: dict[str, Policy] = field(default_factory=dict)
    timeline: deque = field(default_factory=lambda: deque(maxlen=100_000))  # dict rows, oldest dropped
    last_snapshots: dict[str, PipelineSnapshot] = field(default_factory=dict)
    errors: int = 0
    cv_trainer: Any = None  # OnlineCVTrainer: sees every snapshot, trains off the loop, installs its models
    generation: GenerationView | None = None  # the session engine: sessions and KV occupancy per stage
    kicker: Kicker = field(init=False)
    on_kick: Callable[[float], None] | None = None  # asks for a kicked decision (run() / the simulator sets it)
    notes: DecisionNotes | None = None  # the platform's lastDecision and placement log (None: a simulator, a test)
    compute_cores: float = 0.0  # cores the CPU stages' replicas share (policies.compute_budget; 0: not bounded)

    def __post_init__(self) -> None:
        self.collector.registry.register(SnapshotGauges(self.last_snapshots.values))  # read at scrape time
        cfg = self.config
        self.kicker = Kicker(KickConfig(cfg.kick, cfg.kick_surge, cfg.kick_min_interval_s, cfg.kick_min_arrivals,
                                        cfg.kick_min_span_s))
        if cfg.kick:
            self.collector.watch_arrivals(self.note_arrival)

    def note_arrival(self, function: str, now: float) -> None:
        """The collector's arrival hook: ask for a decision now when the arrival kicks one (``gateway_plugin.kick``)."""
        kicker, on_kick = self.kicker, self.on_kick
        if on_kick is None or now - kicker.last_s < kicker.config.min_interval_s:
            return  # the bound first: nothing is measured within it
        metrics = self.collector.stages.get(function)
        if metrics is not None and kicker.check(function, now, *metrics.recent_rate(now)):
            on_kick(now)

    def policy(self, model: str) -> Policy:
        if model not in self.policies:
            self.policies[model] = self.policy_factory()
        return self.policies[model]

    def snapshot(self, model: str, functions: list[str]) -> PipelineSnapshot:
        return build_snapshot(self.clock(), model, functions, self.inventory, self.queues, self.collector,
                              self.config.slo_factor, self.slo_s, self.generation, self.compute_cores)

    def decide(self, kicked: bool = False) -> tuple[dict[str, Decision], list[Change]]:
        """One control period's decisions for every pipeline (or a kicked one's), and the changes they ask of the
        platform (what differs from each stage's desired count and CPUs now). No I/O: the simulator calls this on
        its own clock and applies the changes to its platform; :meth:`step` hands them to the actuator."""
        self.kicker.decided(self.clock())
        decisions: dict[str, Decision] = {}
        changes: list[Change] = []
        for model, functions in self.inventory.pipelines().items():
            snap = self.snapshot(model, functions)
            self.last_snapshots[model] = snap
            policy = self.policy(model)
            if self.cv_trainer is not None:
                self.cv_trainer.install(model, policy)
            desired_now = [self.inventory.stage_state(stage.name).desired for stage in snap.stages]
            wanted = policy.decide(snap)
            if getattr(policy, "sessions_floor", True):  # static-k and a precomputed schedule hold what they say
                wanted = with_session_floor(snap, wanted, self.config.tpot_slo_ms / 1000)
            decision = held_at_zero(snap, bounded(snap, within_compute(snap, wanted)), desired_now)
            if self.cv_trainer is not None and hasattr(policy, "cv_model"):  # only QUART reads a CV model
                self.cv_trainer.observe(snap)
            decisions[model] = decision
            changes.extend(self._changes(snap, decision))
            for stage, want in zip(snap.stages, decision.stages, strict=True):
                self.kicker.arm(stage.name, want.replicas, stage.concurrency, stage.service_rate, stage.recent_rate)
            self._log(snap, decision, kicked)
        return decisions, changes

    async def step(self, kicked: bool = False) -> dict[str, Decision]:
        """One control period for every pipeline, carried out by the actuator; returns the decisions. Every
        change of a desired count is logged and kept by the platform (``note_decision``: the function's
        lastDecision); every replica the platform cannot place is logged once per change (``check_placement``), both
        through ``notes`` (the platform's :class:`~gateway_plugin.ports.DecisionNotes`, when the controller has one)."""
        decisions, changes = self.decide(kicked)
        notes = self.notes
        for change in changes:
            try:
                if change.replicas is not None:
                    why = f"{change.previous} -> {change.replicas}{' (key stage)' if change.key else ''}: " + (
                        change.reason or "policy")
                    log.info("scale %s %s", change.function, why)
                    await self.actuator.scale(change.function, change.replicas, key=change.key)
                    if notes is not None:
                        notes.note_decision(change.function, why)
                if change.cpus is not None:
                    await self.actuator.set_cpus(change.function, change.cpus)
            except Exception as exc:  # an actuator failure must not stop the loop
                self.errors += 1
                log.warning("actuating %s failed: %s", change.function, exc)
        if notes is not None:
            for snap in self.last_snapshots.values():
                for stage in snap.stages:
                    notes.check_placement(stage.name)
        return decisions

    def _changes(self, snap: PipelineSnapshot, decision: Decision) -> list[Change]:
        out = []
        for stage, want in zip(snap.stages, decision.stages, strict=True):
            state = self.inventory.stage_state(stage.name)
            replicas = want.replicas if want.replicas != state.desired else None
            cpus = want.cpus if abs(want.cpus - state.cpus) >= 0.01 else None
            if replicas is not None or cpus is not None:
                out.append(Change(stage.name, replicas, stage.index in decision.key_stages, cpus, state.desired,
                                  want.reason))
        return out

    def _log(self, snap: PipelineSnapshot, decision: Decision, kicked: bool = False) -> None:
        if self.keep_timeline:
            self.timeline.append({
                "time": snap.time, "model": snap.model, "kicked": kicked,
                "replicas": [s.replicas for s in snap.stages],
                "desired": [d.replicas for d in decision.stages],
                "queue": [s.queue_len for s in snap.stages],
                "cpus": [d.cpus for d in decision.stages],
                "key_stages": list(decision.key_stages),
                "reasons": [d.reason for d in decision.stages],
            })
        if self.log_file is not None:
            self.log_file.write(json.dumps({"snapshot": asdict(snap), "decision": asdict(decision)},
                                           separators=(",", ":"), default=str) + "\n")

    async def run(self, stop: asyncio.Event) -> None:
        """Step every ``control_period_s``, and at once when traffic kicks a decision, until ``stop`` is set."""
        period = self.config.control_period_s
        kick = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.on_kick = lambda _now: loop.call_soon_threadsafe(kick.set)  # the collector may be fed from a thread
        next_tick = self.clock()
        try:
            while not stop.is_set():
                ticked = self.clock() >= next_tick
                if ticked:
                    next_tick = self.clock() + period
                kick.clear()
                try:
                    await self.step(kicked=not ticked)
                except Exception as exc:
                    self.errors += 1
                    log.exception("control step failed: %s", exc)
                await wait_either(stop, kick, next_tick - self.clock())
        finally:
            self.on_kick = None


async def wait_either(stop: asyncio.Event, kick: asyncio.Event, seconds: float) -> None:
    """Until ``stop`` or ``kick`` is set, or ``seconds`` pass (always yields to the loop once)."""
    if stop.is_set() or kick.is_set():
        await asyncio.sleep(0)
        return
    waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(kick.wait())}
    try:
        await asyncio.wait(waiters, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
