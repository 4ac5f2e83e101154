"""The control loop: every period, snapshot → policy → sessions' floor → bounds → desired {replicas, CPUs} → actuator.

The one path from a decision to an action, for every policy and for the simulator alike
(``quart_tools.sim`` calls :meth:`Controller.decide` over a simulated inventory and applies its changes on
simulated time; :meth:`Controller.step` hands them to the actuator): the policy decides, a generating stage is
raised to what its sessions need (``policies.decode_capacity``: KV room, decode steps within the TPOT target),
``bounded`` applies ``com.openfaas.scale.min/max`` once, and the actuator is told only what changed.
One policy object per pipeline (policies keep state). Scale-ups of the stages the policy names as
key stages are flagged ``key`` so the placer (the cache-aware scheduler behind the gateway's scale
call) prefers hosts that cache their parameters. Each step's snapshot and decision go to an
optional JSONL log (training data for the CV model) and to ``timeline`` (plots, reports).
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
from gateway_plugin.metrics import MetricsCollector, SnapshotGauges
from gateway_plugin.policies.decode_capacity import with_session_floor
from gateway_plugin.snapshot import Decision, PipelineSnapshot, Policy, StageSnapshot
from gateway_plugin.snapshot_builder import GenerationView, Inventory, QueueView, build_snapshot
from gateway_plugin.zero import held_at_zero
from quart_kernel.replicaset import within_bounds

from keysmanager.aio import wait_event

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

    def __post_init__(self) -> None:
        self.collector.registry.register(SnapshotGauges(self.last_snapshots.values))  # read at scrape time

    def policy(self, model: str) -> Policy:
        if model not in self.policies:
            self.policies[model] = self.policy_factory()
        return self.policies[model]

    def snapshot(self, model: str, functions: list[str]) -> PipelineSnapshot:
        return build_snapshot(self.clock(), model, functions, self.inventory, self.queues, self.collector,
                              self.config.slo_factor, self.slo_s, self.generation)

    def decide(self) -> tuple[dict[str, Decision], list[Change]]:
        """One control period's decisions for every pipeline, and the changes they ask of the platform (what
        differs from each stage's desired count and CPUs now). No I/O: the simulator calls this on its own
        clock and applies the changes to its platform; :meth:`step` hands them to the actuator."""
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
            decision = held_at_zero(snap, bounded(snap, wanted), desired_now)
            if self.cv_trainer is not None and hasattr(policy, "cv_model"):  # only QUART reads a CV model
                self.cv_trainer.observe(snap)
            decisions[model] = decision
            changes.extend(self._changes(snap, decision))
            self._log(snap, decision)
        return decisions, changes

    async def step(self) -> dict[str, Decision]:
        """One control period for every pipeline, carried out by the actuator; returns the decisions. Every
        change of a desired count is logged and kept by the platform (``note_decision``: the function's
        lastDecision); every replica the platform cannot place is logged once per change (``check_placement``)."""
        decisions, changes = self.decide()
        note = getattr(self.inventory, "note_decision", None)
        for change in changes:
            try:
                if change.replicas is not None:
                    why = f"{change.previous} -> {change.replicas}{' (key stage)' if change.key else ''}: " + (
                        change.reason or "policy")
                    log.info("scale %s %s", change.function, why)
                    await self.actuator.scale(change.function, change.replicas, key=change.key)
                    if note is not None:
                        note(change.function, why)
                if change.cpus is not None:
                    await self.actuator.set_cpus(change.function, change.cpus)
            except Exception as exc:  # an actuator failure must not stop the loop
                self.errors += 1
                log.warning("actuating %s failed: %s", change.function, exc)
        if hasattr(self.inventory, "check_placement"):
            for snap in self.last_snapshots.values():
                for stage in snap.stages:
                    self.inventory.check_placement(stage.name)
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

    def _log(self, snap: PipelineSnapshot, decision: Decision) -> None:
        if self.keep_timeline:
            self.timeline.append({
                "time": snap.time, "model": snap.model,
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
        """Step every ``control_period_s`` until ``stop`` is set."""
        period = self.config.control_period_s
        while not stop.is_set():
            started = self.clock()
            try:
                await self.step()
            except Exception as exc:
                self.errors += 1
                log.exception("control step failed: %s", exc)
            await wait_event(stop, period - (self.clock() - started))
