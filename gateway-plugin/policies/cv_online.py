"""Online training of QUART's CV-propagation model from the snapshots the controller takes, off the control loop.

The controller hands every snapshot to ``OnlineCVTrainer.observe`` (an append to a bounded deque: O(1),
no training). Every ``interval_s`` of snapshot time, once ``min_snapshots`` of a pipeline are held, a
copy of its series is trained on in a background thread (``gateway_plugin.policies.cv_model.train_cv_model``);
at most one training runs at a time. A finished model is published atomically (one dict assignment) and
``install`` hands it to the pipeline's policy before a later step (the policy reads ``cv_model`` once per
decision, so it never sees a half-trained model). The control loop never waits for a training.
``synchronous=True`` trains in the caller instead (the simulator: deterministic, no threads).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway_plugin.snapshot import PipelineSnapshot

log = logging.getLogger("quart.cv_online")


@dataclass
class OnlineCVTrainer:
    """Keeps each pipeline's recent snapshots and retrains its CV model in the background."""

    min_snapshots: int = 120  # two minutes at the default 1 s period
    max_snapshots: int = 1800  # train on the last half hour at most
    interval_s: float = 120.0  # retrain this often (snapshot time)
    epochs: int = 200
    synchronous: bool = False
    train: Callable | None = None  # (series, epochs) -> model; default train_cv_model
    series: dict[str, deque] = field(default_factory=dict)
    models: dict[str, object] = field(default_factory=dict)  # latest trained model per pipeline
    trained_at: dict[str, float] = field(default_factory=dict)
    trainings: int = 0
    failures: int = 0
    _busy: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def observe(self, snapshot: PipelineSnapshot) -> None:
        """Record one snapshot; start a training when one is due and none runs (never blocks on one)."""
        q = self.series.setdefault(snapshot.model, deque(maxlen=self.max_snapshots))
        if q and len(q[-1].stages) != len(snapshot.stages):
            q.clear()  # the pipeline was redeployed with another stage count: the old series no longer fits
        q.append(snapshot)
        last = self.trained_at.get(snapshot.model)
        due = len(q) >= self.min_snapshots and (last is None or snapshot.time - last >= self.interval_s)
        if not due or not self._busy.acquire(blocking=False):
            return
        self.trained_at[snapshot.model] = snapshot.time
        series = list(q)
        if self.synchronous:
            self._train(snapshot.model, series)
        else:
            self._thread = threading.Thread(target=self._train, args=(snapshot.model, series), daemon=True,
                                            name=f"cv-train-{snapshot.model}")
            self._thread.start()

    def _train(self, model: str, series: list[PipelineSnapshot]) -> None:
        try:
            if self.train is not None:
                trained = self.train(series, self.epochs)
            else:
                from gateway_plugin.policies.cv_model import train_cv_model

                trained, _ = train_cv_model(series, epochs=self.epochs)
            self.models[model] = trained
            self.trainings += 1
        except Exception as exc:  # a failed training leaves the last model (or the observed CV) in use
            self.failures += 1
            log.warning("CV model training for %s failed: %s", model, exc)
        finally:
            self._busy.release()

    def install(self, model: str, policy: object) -> bool:
        """Give ``policy`` the latest model of ``model`` if it takes one and has an older one; True if changed."""
        trained = self.models.get(model)
        if trained is None or not hasattr(policy, "cv_model") or policy.cv_model is trained:
            return False
        policy.cv_model = trained  # type: ignore[attr-defined]
        return True

    def join(self, timeout: float | None = None) -> None:
        """Wait for a running training (tests, shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout)
