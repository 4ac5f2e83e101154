"""OpenFaaS Community Edition alert-based autoscaling, per function (here: per stage function).

Source: openfaas/faas `prometheus/alert.rules.yml` (APIHighInvocationRate:
`sum by (function_name) (rate(gateway_function_invocation_total{code="200"}[10s])) > 5`, `for: 5s`),
`alertmanager.yml` (group_interval 10 s), gateway `scaling/` (on firing: replicas += ceil(max ×
com.openfaas.scale.factor / 100), default factor 20 %; on resolved: replicas = min). The window's
arrival rate stands in for the invocation rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway_plugin.config import OpenFaaSCEConfig
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision


@dataclass(slots=True)
class _Alert:
    pending_since: float | None = None
    firing: bool = False
    last_sent: float = -math.inf
    desired: int | None = None


@dataclass(slots=True)
class OpenFaaSCEPolicy:
    config: OpenFaaSCEConfig = field(default_factory=OpenFaaSCEConfig)
    name: str = "openfaas-ce"
    _alerts: dict[int, _Alert] = field(default_factory=dict)

    def decide(self, snapshot: PipelineSnapshot) -> Decision:
        cfg, now, out = self.config, snapshot.time, []
        for s in snapshot.stages:
            al = self._alerts.setdefault(s.index, _Alert())
            if al.desired is None:
                al.desired = max(s.min_replicas, s.replicas)
            reason = f"rate={s.arrival_rate:.2f}"
            if s.arrival_rate > cfg.rps_threshold:
                if al.pending_since is None:
                    al.pending_since = now
                if now - al.pending_since >= cfg.fire_for_s:
                    al.firing = True
                    if now - al.last_sent >= cfg.repeat_s:
                        step = max(1, math.ceil(s.max_replicas * cfg.scale_factor))
                        al.desired = min(s.max_replicas, max(al.desired, s.replicas) + step)
                        al.last_sent = now
                        reason += " alert firing"
            else:
                al.pending_since = None
                if al.firing:
                    al.firing = False
                    al.desired = s.min_replicas
                    reason += " alert resolved"
            out.append(StageDecision(al.desired, s.cpus, reason))
        return Decision(now, tuple(out))
