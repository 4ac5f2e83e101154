"""A scripted autoscaling policy for the simulator tests: every stage's replicas follow a time-indexed plan."""

from __future__ import annotations

from gateway_plugin.snapshot import Decision, StageDecision


class Scripted:
    """Test double: replicas of every stage by time, from a list of (from_time, replicas)."""

    name = "scripted"

    def __init__(self, plan: list[tuple[float, int]]):
        self.plan = plan

    def decide(self, snap):
        want = [r for t, r in self.plan if snap.time >= t][-1]
        return Decision(snap.time, tuple(StageDecision(want) for _ in snap.stages))
