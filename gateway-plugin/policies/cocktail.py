"""Cocktail-style predictive, model-granular scaling (Gunasekaran et al., "Cocktail", NSDI 2022).

Cocktail forecasts the next interval's request rate and provisions whole-model instances for it with
headroom. The paper's predictor is a learned time-series model; here Holt's linear (double
exponential) smoothing of the per-period rate stands in, forecasting ``horizon_s`` ahead. Instances
= ceil(forecast × headroom / pipelined instance throughput); scale-down at most once per cooldown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway_plugin.config import CocktailConfig
from gateway_plugin.policies.whole_model import (
    current_instances,
    instance_throughput,
    model_rate,
    uniform_decision,
)
from gateway_plugin.snapshot import Decision, PipelineSnapshot


@dataclass(slots=True)
class CocktailPolicy:
    config: CocktailConfig = field(default_factory=CocktailConfig)
    name: str = "cocktail"
    _level: float | None = None
    _trend: float = 0.0
    _last_time: float | None = None
    _last_down: float = -math.inf

    def forecast(self, time: float, rate: float) -> float:
        cfg = self.config
        if self._level is None or self._last_time is None:
            self._level, self._last_time = rate, time
            return rate
        dt = max(1e-6, time - self._last_time)
        prev = self._level
        self._level = cfg.alpha * rate + (1 - cfg.alpha) * (self._level + self._trend * dt)
        self._trend = cfg.beta * (self._level - prev) / dt + (1 - cfg.beta) * self._trend
        self._last_time = time
        return max(0.0, self._level + self._trend * cfg.horizon_s)

    def decide(self, snapshot: PipelineSnapshot) -> Decision:
        cfg = self.config
        rate = model_rate(snapshot)
        predicted = self.forecast(snapshot.time, rate)
        current = current_instances(snapshot)
        thr = instance_throughput(snapshot, pipelined=True)
        if thr <= 0:
            return uniform_decision(snapshot, current, "no profile")
        needed = math.ceil(predicted * cfg.headroom / thr - 1e-9)
        desired = needed
        if needed < current:
            if snapshot.time - self._last_down >= cfg.cooldown_s:
                self._last_down = snapshot.time
            else:
                desired = current
        return uniform_decision(snapshot, desired, f"rate={rate:.2f} forecast={predicted:.2f}")
