"""How a function's replica set converges on its desired count: pure rules, shared by the live provider and
the simulator (``quart_tools.sim``), so a simulated figure rests on the same choices.

- ``within_bounds``: a replica count within ``com.openfaas.scale.min/max`` (the one bounds rule);
- ``shortfall``: how many replicas to ask the placer for (desired − current − already asked for);
- ``choose_surplus``: which replicas to stop when there are too many — a starting replica first (newest
  first: it has served nothing), then ready ones holding the fewest generation sessions' KV positions
  (``kv_tokens``: a replica without sessions leaves before one with), then the fewest requests in flight
  (newest first); a busy replica is drained (finishes its requests, its sessions move) by the caller,
  never cut off;
- ``StartTimeEstimate``: the ask → ready time of recent replicas (exponential moving average), the dead
  time the control loop sees as ``StageSnapshot.replica_start_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

START_TIME_ALPHA = 0.3  # weight of the newest ask → ready sample


class ReplicaLike(Protocol):
    """What the surplus choice reads of a replica (the provider's Endpoint, the simulator's Replica)."""

    @property
    def state(self) -> str: ...  # "starting" | "ready" | ...

    @property
    def in_flight(self) -> int: ...

    @property
    def kv_tokens(self) -> int: ...  # KV-cache positions its generation sessions hold (booked by the gateway)

    @property
    def started_at(self) -> float: ...


R = TypeVar("R", bound=ReplicaLike)


def within_bounds(replicas: int, max_replicas: int, min_replicas: int = 0) -> int:
    """``replicas`` clamped to ``min_replicas`` … ``max_replicas`` (``com.openfaas.scale.min/max``): the one bounds
    rule. The controller applies the labels' min and max; the registry, the one writer of a function's desired
    count, applies max to every count it is given (an API scale may go below min, as on OpenFaaS)."""
    return max(min_replicas, min(max_replicas, int(replicas)))


def shortfall(desired: int, current: int, pending: int = 0) -> int:
    """Replicas still to ask for: desired − (current + asked for and not started yet), never negative."""
    return max(0, desired - current - pending)


def choose_surplus(current: Sequence[R], desired: int) -> list[R]:
    """The replicas to stop so that ``desired`` of ``current`` remain (empty if there are not too many)."""
    extra = len(current) - max(0, desired)
    if extra <= 0:
        return []
    order = sorted(current, key=lambda r: (r.state == "ready", r.kv_tokens, r.in_flight, -r.started_at))
    return order[:extra]


def rollover_done(ready_current: int, desired: int) -> bool:
    """A rolling update may drain the previous generation once the new one has ``desired`` ready replicas."""
    return desired == 0 or ready_current >= desired


def note_key_scale(history: dict[str, int], function: str, before: int, after: int, key: bool) -> None:
    """Count a scale-up the policy flagged as a key stage's (the placer's key-stage history, QUART §6)."""
    if key and after > before:
        history[function] = history.get(function, 0) + 1


@dataclass(slots=True)
class StartTimeEstimate:
    """Ask → ready seconds of a function's replicas, smoothed; ``seconds`` < 0 until the first sample."""

    seconds: float = -1.0
    alpha: float = START_TIME_ALPHA

    def note(self, sample_s: float) -> float:
        """Fold in one replica's ask → ready time; returns the new estimate."""
        if self.seconds < 0:
            self.seconds = sample_s
        else:
            self.seconds = (1 - self.alpha) * self.seconds + self.alpha * sample_s
        return self.seconds
