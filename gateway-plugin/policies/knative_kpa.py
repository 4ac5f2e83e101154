"""Knative Pod Autoscaler (KPA), per stage, from the knative/serving autoscaler design and defaults.

Source: knative.dev/docs/serving/autoscaling (config-autoscaler: stable-window 60s,
panic-window-percentage 10 → 6 s, panic-threshold-percentage 200, container-concurrency-target-
percentage 70, max-scale-up-rate 1000, max-scale-down-rate 2, scale-down-delay 0s) and
pkg/autoscaler/scaling/autoscaler.go: desired = ceil(avg concurrency / (cc × target%)) over the stable
window; panic mode starts when the panic-window desire ≥ 2 × ready pods and lasts a stable window,
during which the replica count never decreases. Concurrency = requests in service + waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway_plugin.config import KnativeKPAConfig
from gateway_plugin.policies.history import SampleWindow
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision


@dataclass(slots=True)
class _KPAState:
    concurrency: SampleWindow
    desired_history: SampleWindow
    panic_since: float | None = None
    panic_desired: int = 0


@dataclass(slots=True)
class KnativeKPAPolicy:
    config: KnativeKPAConfig = field(default_factory=KnativeKPAConfig)
    name: str = "knative-kpa"
    _state: dict[int, _KPAState] = field(default_factory=dict)

    def decide(self, snapshot: PipelineSnapshot) -> Decision:
        cfg, now, out = self.config, snapshot.time, []
        panic_window = cfg.stable_window_s * cfg.panic_window_percentage / 100.0
        per_pod = cfg.container_concurrency * cfg.target_utilization
        for s in snapshot.stages:
            st = self._state.setdefault(
                s.index,
                _KPAState(SampleWindow(cfg.stable_window_s), SampleWindow(max(cfg.scale_down_delay_s, 1e-9))),
            )
            st.concurrency.add(now, float(s.in_flight))
            ready = max(1, s.replicas)
            stable = math.ceil(st.concurrency.mean(cfg.stable_window_s) / per_pod - 1e-9)
            panic = math.ceil(st.concurrency.mean(panic_window) / per_pod - 1e-9)
            if panic / ready >= cfg.panic_threshold:
                if st.panic_since is None:
                    st.panic_desired = ready
                st.panic_since = now
            elif st.panic_since is not None and now - st.panic_since >= cfg.stable_window_s:
                st.panic_since = None
            if st.panic_since is not None:
                desired = max(panic, st.panic_desired)  # never scale down while panicking
                st.panic_desired = desired
                reason = f"panic c6={st.concurrency.mean(panic_window):.2f}"
            else:
                desired = stable
                reason = f"stable c60={st.concurrency.mean(cfg.stable_window_s):.2f}"
            desired = min(desired, math.ceil(ready * cfg.max_scale_up_rate))
            desired = max(desired, math.floor(ready / cfg.max_scale_down_rate))
            if cfg.scale_down_delay_s > 0:
                st.desired_history.add(now, float(desired))
                desired = int(st.desired_history.max(cfg.scale_down_delay_s))
            out.append(StageDecision(desired, s.cpus, reason))
        return Decision(now, tuple(out))
