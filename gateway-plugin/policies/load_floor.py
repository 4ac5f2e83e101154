"""Rules 8 and 9 of QUART's provisioning corrector (issue 32): what rate a stage is sized for in a pipeline.

8. **Entry sizes the pipeline**: every request visits every stage, so a stage after the entry carries the
   entry's load, shifted by the stages before it. Its own windowed peak can only exceed the entry's where an
   upstream queue released a burst compressed — and then at most at what the upstream replicas serve, which the
   backlog rules (4) size for. Sized by its own peak, a later stage asked a replica its entry stage did not
   (BERT-21B CV 4 seed 0: 7 stages at 5, the entry at 4 for 80 s, 2.2 % of the replica-seconds for no latency).
9. **Long-run floor** (``LoadFloor``): a stage is sized for at least mean + z·σ of its 5 s mean rates over the
   last ``floor_horizon_s``. The observed 30 s peak of a bursty stream falls in its lulls and rises with its
   bursts, so the count wandered over three levels (BERT-21B CV 8: 4, 5 and 6 replicas); the static frontier is
   convex, so time at k − 1 and k + 1 costs more latency than time at k and k + 1 at the same mean
   (static-4 481 ms, static-5 338, static-6 273). z ≈ the expected largest sliding 5 s mean of a 30 s window
   (1.75 σ for gamma streams of CV 1–8), so the floor is the level the peak rule holds on average.

Pure: the samples are the policy's own; time comes from the snapshots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway_plugin.policies.history import SampleWindow

MIN_FLOOR_SAMPLES = 20  # window means before the floor says anything (the start-up estimate covers the first)


@dataclass(slots=True)
class LoadFloor:
    """mean + z·σ of a stage's window mean rates over ``horizon_s`` (rule 9); 0 when off or too few samples."""

    horizon_s: float
    z: float
    means: SampleWindow = field(init=False)

    def __post_init__(self) -> None:
        self.means = SampleWindow(self.horizon_s)

    def add(self, time: float, window_mean: float) -> None:
        if self.horizon_s > 0:
            self.means.add(time, window_mean)

    def rate(self) -> float:
        values = [v for _, v in self.means.samples]
        if self.horizon_s <= 0 or len(values) < MIN_FLOOR_SAMPLES:
            return 0.0
        mean = sum(values) / len(values)
        sd = math.sqrt(max(0.0, sum((v - mean) ** 2 for v in values) / (len(values) - 1)))
        return mean + self.z * sd


def sizing_rate(own_peak: float, entry_peak: float, window_rate: float, is_entry: bool, entry_only: bool) -> float:
    """The rate a stage is sized for (rules 2 and 8): its own peak and the entry stage's; a later stage only the
    entry's when ``entry_only`` (its window rate still counts: a stage fed from elsewhere)."""
    own = own_peak if is_entry or not entry_only or entry_peak <= 0 else 0.0
    return max(own, entry_peak, window_rate)
