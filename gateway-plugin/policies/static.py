"""Static provisioning: a fixed number of replicas per stage, whatever the load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from gateway_plugin.config import StaticConfig
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision


@dataclass(slots=True)
class StaticPolicy:
    config: StaticConfig = field(default_factory=StaticConfig)
    name: str = "static"
    sessions_floor: ClassVar[bool] = False  # it holds its k replicas whatever the sessions (the frontier's yardstick)

    def decide(self, snapshot: PipelineSnapshot) -> Decision:
        stages = tuple(
            StageDecision(self.config.replicas, s.cpus, "static")
            for s in snapshot.stages
        )
        return Decision(snapshot.time, stages)
