"""The traffic kick: a control decision as soon as a stage's load jumps, not only on the period's tick.

Knative does this for every revision: the activator pokes the autoscaler on the first request to a revision
instead of waiting for the next tick, and the KPA's panic mode reacts to a short window. Here it is the platform's
timing, for every policy alike (the policy is not told whether a decision was kicked): on an arrival at a stage,
:func:`kick_due` says whether the controller should decide now.

A stage is *armed* after every decision (tick or kick) at ``surge`` × max(the capacity the decision asked for —
desired replicas × slots × μ — and the rate it saw). Arrivals kick when the stage's recent rate
(`gateway_plugin.metrics.StageMetrics.surge_rate`: the last second, or the time since its traffic began when that
is shorter) reaches the armed rate, over at least ``min_arrivals`` arrivals and ``min_span_s`` of traffic (a rate
from a handful of arrivals is noise). The first traffic after idle meets a stage armed at its idle capacity; a surge
beyond what its replicas serve meets one armed at that capacity; a surge the policy chose not to follow (its cluster
full, its own alert delay) re-kicks only once the rate has grown by another ``surge`` ×. The bound: no kick within
``min_interval_s`` of the last decision or kick, whatever the traffic, so a storm cannot spin the controller.

Pure: time comes from the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KickConfig:
    """The kick's settings (``PluginConfig.kick*``, docs/configuration.md)."""

    enabled: bool = True
    surge: float = 2.0  # arrivals at ≥ this × max(the capacity asked, the rate seen) at the last decision
    min_interval_s: float = 0.25  # at most one kicked decision per this long (after any decision)
    min_arrivals: int = 8  # ... over at least this many arrivals
    min_span_s: float = 0.5  # ... and this long of the stage's traffic (half a period: a rate from less is noise)


def armed_rate(desired: int, slots: int, service_rate: float, rate_seen: float, surge: float) -> float:
    """The recent rate that kicks the next decision: ``surge`` × max(capacity asked, rate seen); 0 while the
    capacity is unknown and nothing was seen (the first traffic kicks once it is measurable)."""
    capacity = max(0, desired) * max(1, slots) * max(0.0, service_rate)
    return surge * max(capacity, max(0.0, rate_seen))


def kick_due(now: float, rate: float, arrivals: int, span_s: float, armed: float, last_s: float,
             cfg: KickConfig) -> bool:
    """Whether an arrival at ``now`` kicks a decision: the stage's recent ``rate`` (over ``arrivals`` arrivals
    and ``span_s`` seconds of its traffic) at or above its ``armed`` rate, and the last decision or kick at least
    ``min_interval_s`` ago (``last_s``)."""
    return (cfg.enabled and arrivals >= cfg.min_arrivals and span_s >= cfg.min_span_s
            and rate >= armed and now - last_s >= cfg.min_interval_s)


@dataclass(slots=True)
class Kicker:
    """The controller's kick state: each stage's armed rate, the last decision or kick, the kicks so far."""

    config: KickConfig = field(default_factory=KickConfig)
    armed: dict[str, float] = field(default_factory=dict)  # function → armed rate (absent: 0, the first traffic)
    last_s: float = -math.inf  # the last decision, or the last kick asked for
    kicks: int = 0

    def arm(self, function: str, desired: int, slots: int, service_rate: float, rate_seen: float) -> None:
        self.armed[function] = armed_rate(desired, slots, service_rate, rate_seen, self.config.surge)

    def decided(self, now: float) -> None:
        self.last_s = max(self.last_s, now)

    def check(self, function: str, now: float, rate: float, arrivals: int, span_s: float) -> bool:
        """True (and the kick counted, the bound started) when an arrival at ``function`` kicks a decision now."""
        if not kick_due(now, rate, arrivals, span_s, self.armed.get(function, 0.0), self.last_s, self.config):
            return False
        self.last_s, self.kicks = now, self.kicks + 1
        return True
