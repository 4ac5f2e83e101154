"""Emulated compute: a stage's service time drawn from a gamma distribution (mean, CV).

Pure: the sampler takes its random source; the runtime does the sleeping. Means come from
``QUART_EMULATED_MEAN_MS`` or from a paper profile (Table 1 model time split over the stages in
proportion to their parameter bytes, or evenly when the partition has no weights).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from quart_stage.presets import paper_profile


@dataclass(frozen=True)
class ServiceTime:
    """Gamma-distributed service time with the given mean (ms) and coefficient of variation."""

    mean_ms: float
    cv: float

    def sample_ms(self, rng: random.Random) -> float:
        if self.mean_ms <= 0:
            return 0.0
        if self.cv <= 0:
            return self.mean_ms
        shape = 1.0 / (self.cv * self.cv)
        return rng.gammavariate(shape, self.mean_ms / shape)


def stage_share(stage_bytes: list[int], index: int) -> float:
    """Fraction of the model's time that stage `index` takes: by parameter bytes, or 1/N without weights."""
    total = sum(stage_bytes)
    if total <= 0:
        return 1.0 / len(stage_bytes)
    return stage_bytes[index] / total


def service_time_for(
    *, mean_ms: float | None, cv: float, profile: str | None, stage_bytes: list[int], index: int
) -> ServiceTime:
    """The service time of stage `index`: an explicit mean wins, else the profile's share."""
    if mean_ms is not None:
        return ServiceTime(mean_ms, cv)
    if profile is None:
        raise ValueError("emulated compute needs QUART_PROFILE (a paper model) or QUART_EMULATED_MEAN_MS")
    return ServiceTime(paper_profile(profile).exec_ms * stage_share(stage_bytes, index), cv)
