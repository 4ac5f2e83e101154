"""INFless-style whole-model scaling (Yang et al., "INFless", ASPLOS 2022), as the QUART paper ran it.

The model is served as one function: every stage is scaled together to the same instance count. The
count is RPS-driven: ceil(λ / (instance throughput × utilisation)), where an instance serves one
request at a time through the whole model (no pipelining; `pipelined=True` in make_policy config
gives the pipelined variant). Idle instances are kept alive for ``keep_alive_s`` before removal.
Cold starts from disk are a property of the deployment (the placer), not of this policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway_plugin.config import INFlessConfig
from gateway_plugin.policies.whole_model import (
    current_instances,
    instance_throughput,
    model_rate,
    uniform_decision,
)
from gateway_plugin.snapshot import Decision, PipelineSnapshot


@dataclass(slots=True)
class INFlessPolicy:
    config: INFlessConfig = field(default_factory=INFlessConfig)
    pipelined: bool = False
    name: str = "infless"
    _surplus_since: float | None = None

    def decide(self, snapshot: PipelineSnapshot) -> Decision:
        current = current_instances(snapshot)
        thr = instance_throughput(snapshot, self.pipelined) * self.config.utilisation
        if thr <= 0:
            return uniform_decision(snapshot, current, "no profile")
        rate = model_rate(snapshot)
        needed = math.ceil(rate / thr - 1e-9)
        desired = current
        if needed >= current:
            desired, self._surplus_since = needed, None
        else:
            if self._surplus_since is None:
                self._surplus_since = snapshot.time
            if snapshot.time - self._surplus_since >= self.config.keep_alive_s:
                desired, self._surplus_since = needed, None
        return uniform_decision(snapshot, desired, f"rps={rate:.2f} per-instance={thr:.2f}")
