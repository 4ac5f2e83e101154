"""Diagnostic policy variants: proposed fixes measured on the simulator, NOT the shipped policies.

``RhoFloor`` wraps a policy and never lets a stage's replicas fall below the fewest that keep
ρ = λ / (r·μ) ≤ ``rho_max`` at the larger of the window and last-second arrival rates — the floor the QUART corrector applies only
while a stage is already unstable. On the paper cluster the shipped corrector scales a stage down to
a count where ρ > 1 (e.g. λ = 259/s, μ = 108/s, 4 → 2 replicas); the queue then explodes, the stage
jumps to its maximum and the 30 s cooldown holds those slots while other stages starve on a full
cluster. System name: ``quart+rho-floor`` (docs/simulator.md). The fix belongs in
gateway_plugin.policies.correct; this wrapper only measures what it would change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway_plugin.policies.queueing import servers_for_utilisation
from gateway_plugin.snapshot import Decision, PipelineSnapshot


@dataclass
class RhoFloor:
    inner: object
    rho_max: float = 0.95
    name: str = "quart+rho-floor"

    @property
    def key_history(self):
        return getattr(self.inner, "key_history", None)

    def decide(self, snapshot: PipelineSnapshot) -> Decision:
        decision = self.inner.decide(snapshot)  # type: ignore[attr-defined]
        stages = []
        for s, d in zip(snapshot.stages, decision.stages, strict=True):
            rate = max(s.arrival_rate, s.recent_rate)
            floor = servers_for_utilisation(rate, s.service_rate, self.rho_max) if s.service_rate > 0 else 0
            floor = -(-floor // max(1, s.concurrency))
            stages.append(replace(d, replicas=min(s.max_replicas, max(d.replicas, floor))))
        return Decision(decision.time, tuple(stages), decision.key_stages)
