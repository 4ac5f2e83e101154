"""InferLine-style per-stage tuner (Crankshaw et al., "InferLine", SoCC 2020, §5).

Each stage is provisioned from its own arrival rate against its profiled per-replica throughput μ_i:
the tuner keeps a traffic envelope — the peak arrival rate over several window sizes — and scales a
stage up as soon as the envelope exceeds what its replicas sustain at the planned utilisation; it
scales down conservatively, only after the envelope has stayed below capacity for a delay, and only
to what the envelope over a longer window needs. Rates are sampled once per control period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway_plugin.config import InferLineConfig
from gateway_plugin.policies.batch_capacity import capacity_rate
from gateway_plugin.policies.history import SampleWindow
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision


@dataclass(slots=True)
class _TunerState:
    rates: SampleWindow
    below_since: float | None = None


@dataclass(slots=True)
class InferLinePolicy:
    config: InferLineConfig = field(default_factory=InferLineConfig)
    name: str = "inferline"
    _state: dict[int, _TunerState] = field(default_factory=dict)

    def decide(self, snapshot: PipelineSnapshot) -> Decision:
        cfg, now, out = self.config, snapshot.time, []
        horizon = max(max(cfg.window_sizes_s), cfg.scale_down_window_s)
        for s in snapshot.stages:
            st = self._state.setdefault(s.index, _TunerState(SampleWindow(horizon)))
            st.rates.add(now, s.recent_rate)
            current = s.replicas + s.pending_replicas
            capacity = capacity_rate(s) * max(1, s.concurrency) * cfg.utilisation  # at full batches
            if capacity <= 0:
                out.append(StageDecision(current, s.cpus, "no profile"))
                continue
            envelope = max(st.rates.mean(w) for w in cfg.window_sizes_s)
            needed = math.ceil(envelope / capacity - 1e-9)
            desired, reason = current, f"envelope={envelope:.2f}"
            if needed > current:
                desired, st.below_since = needed, None
            elif needed < current:
                if st.below_since is None:
                    st.below_since = now
                if now - st.below_since >= cfg.scale_down_delay_s:
                    desired = max(needed, math.ceil(st.rates.max(cfg.scale_down_window_s) / capacity - 1e-9))
                    st.below_since = None if desired >= current else now
            else:
                st.below_since = None
            out.append(StageDecision(desired, s.cpus, reason))
        return Decision(now, tuple(out))
