"""A scripted policy for simulator tests: every stage's replicas by time, from a list of (from_time, replicas)."""

from __future__ import annotations

from gateway_plugin.snapshot import Decision, StageDecision


class Scripted:
    """Test double of a policy (`gateway_plugin.policies` shape): the last planned count whose time has come."""

    name = "scripted"

    def __init__(self, plan: list[tuple[float, int]]):
        self.plan = plan

    def decide(self, snap):
        want = [r for t, r in self.plan if snap.time >= t][-1]
        return Decision(snap.time, tuple(StageDecision(want) for _ in snap.stages))
