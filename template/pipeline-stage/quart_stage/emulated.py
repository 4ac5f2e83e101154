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


@dataclass(frozen=True)
class StepTime:
    """Emulated time of one generation step of this stage: ``max(decode_ms, positions * prefill_ms_per_token)``
    (a one-position decode step costs a weight read; a prefill costs its positions), gamma-distributed with ``cv``."""

    decode_ms: float
    prefill_ms_per_token: float
    cv: float

    def mean_ms(self, positions: int) -> float:
        return max(self.decode_ms, positions * self.prefill_ms_per_token)

    def sample_ms(self, positions: int, rng: random.Random) -> float:
        return ServiceTime(self.mean_ms(positions), self.cv).sample_ms(rng)


def step_time_for(
    *, decode_ms: float | None, prefill_ms_per_token: float | None, mean_ms: float | None, cv: float,
    profile: str | None, stage_bytes: list[int], index: int
) -> StepTime | None:
    """This stage's generation step time: explicit settings win, else the profile's decode time and prefill time
    per token times the stage's share; without a profile the one-shot mean is the decode time. None when the
    profile is not a decoder (no generation)."""
    share = stage_share(stage_bytes, index)
    p = paper_profile(profile) if profile is not None else None
    if p is not None and p.decode_ms is None and decode_ms is None:
        return None
    if decode_ms is None:
        decode_ms = p.decode_ms * share if p is not None else (mean_ms or 0.0)
    if prefill_ms_per_token is None:
        prefill_ms_per_token = p.exec_ms / p.seq * share if p is not None else 0.0
    return StepTime(decode_ms, prefill_ms_per_token, cv)
