"""Settings of the placers (QUART §6.2), one dataclass with documented defaults.

Every field can be overridden from the environment as ``QUART_SCHED_<FIELD>`` (upper case), e.g.
``QUART_SCHED_CONTENTION_THRESHOLD=0.75``; see :meth:`SchedulerConfig.from_env`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from quart_stage.settings import settings_from_env


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Knobs of the cache-aware placer.

    Contention is ``requested replicas / free GPU slots`` over all hosts, measured on the batch the
    placer is asked to place. At or above ``contention_threshold`` key-stage replicas are spread by
    KL-divergence dispersion; below it the greedy low-contention rules apply.
    """

    contention_threshold: float = 0.5  # requested / free slots at or above which KL dispersion is used
    cache_weight: float = 0.5  # γ: cost of a cold start per replica in the dispersion objective
    learning_rate: float = 0.5  # α of Eq. 10 (first try of each step; halved on overshoot)
    max_iterations: int = 500  # gradient steps at most
    tolerance: float = 1e-7  # converged when the objective improves by less than this (relative)
    kl_threshold: float = 1e-6  # stop early once Σ KL is this close to the uniform target
    projection_rounds: int = 50  # alternating row-simplex / column-capacity projections per step
    # converged also when the last `stall_window` steps lowered the objective by less than `stall_fraction`
    # of the whole descent so far (0 = off): the slow tail of projected gradient descent moves no placement
    stall_window: int = 20
    stall_fraction: float = 1e-3
    # fraction of a host's reported memory limit a cold start may fill without counting as evicting; the
    # KeysManager already applies its own threshold (85 % of RAM) when it derives that limit
    memory_fill: float = 1.0
    # host memory a cold start adds, in parameter sizes: the cold replica's private copy plus the zygote
    # the KeysManager caches after it (cache_on_cold); both count against the host's limit
    cold_copies: float = 2.0

    def __post_init__(self) -> None:
        if self.contention_threshold < 0:
            raise ValueError("contention_threshold must be ≥ 0")
        if self.cache_weight < 0:
            raise ValueError("cache_weight must be ≥ 0")
        if not self.learning_rate > 0:
            raise ValueError("learning_rate must be > 0")
        if self.max_iterations < 1:
            raise ValueError("max_iterations must be ≥ 1")
        if self.cold_copies < 0:
            raise ValueError("cold_copies must be ≥ 0")
        if not 0 < self.memory_fill <= 1:
            raise ValueError("memory_fill must be in (0, 1]")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> SchedulerConfig:
        """Defaults, then ``QUART_SCHED_*`` variables from `env` (os.environ by default; ``quart_stage.settings``
        rules), then `overrides`."""
        return settings_from_env(cls, "QUART_SCHED_", env, **overrides)
