"""The online CV-model trainer: records snapshots in O(1), trains off the control loop, installs the result."""

from __future__ import annotations

import threading
import time

from gateway_plugin.policies import make_policy
from gateway_plugin.policies.cv_model import CVPropagationModel
from gateway_plugin.policies.cv_online import OnlineCVTrainer
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot


def snap(t: float, cv: float = 1.0, stages: int = 3) -> PipelineSnapshot:
    return PipelineSnapshot(time=t, model="m", stages=tuple(
        StageSnapshot(name=f"m-stage-{i}", index=i, arrival_rate=5.0 + t % 3, service_rate=10.0, replicas=1,
                      cv_arrival=cv + 0.1 * i) for i in range(stages)))


def test_training_runs_in_the_background_and_never_blocks_observe() -> None:
    release = threading.Event()
    calls = []

    def slow_train(series, epochs):
        calls.append(len(series))
        release.wait(10)
        return "model-1"

    trainer = OnlineCVTrainer(min_snapshots=5, interval_s=100.0, train=slow_train)
    policy = make_policy("quart")
    started = time.perf_counter()
    for t in range(20):  # the training starts at the 5th snapshot and blocks until released
        trainer.observe(snap(float(t)))
    assert time.perf_counter() - started < 1.0  # observe never waited for it
    assert calls == [5] and not trainer.install("m", policy) and policy.cv_model is None
    release.set()
    trainer.join(5)
    assert trainer.install("m", policy) and policy.cv_model == "model-1"
    assert not trainer.install("m", policy)  # already installed
    assert not trainer.install("m", make_policy("static"))  # a policy without a CV model is left alone


def test_retrains_every_interval_on_at_most_max_snapshots() -> None:
    seen = []
    trainer = OnlineCVTrainer(min_snapshots=4, max_snapshots=6, interval_s=5.0, synchronous=True,
                              train=lambda series, epochs: seen.append(len(series)) or f"m{len(seen)}")
    for t in range(16):
        trainer.observe(snap(float(t)))
    assert seen == [4, 6, 6]  # at t = 3, 8, 13
    assert trainer.models["m"] == "m3" and trainer.trainings == 3


def test_a_failed_training_keeps_the_observed_cv_and_a_new_stage_count_resets_the_series() -> None:
    def broken(series, epochs):
        raise ValueError("no")

    trainer = OnlineCVTrainer(min_snapshots=2, synchronous=True, train=broken)
    for t in range(3):
        trainer.observe(snap(float(t)))
    assert trainer.failures == 1 and "m" not in trainer.models
    trainer.observe(snap(3.0, stages=4))
    assert len(trainer.series["m"]) == 1


def test_a_real_model_is_trained_and_used_by_quart() -> None:
    trainer = OnlineCVTrainer(min_snapshots=10, epochs=20, synchronous=True)
    for t in range(12):
        trainer.observe(snap(float(t), cv=2.0 + (t % 2)))
    policy = make_policy("quart")
    assert trainer.install("m", policy) and isinstance(policy.cv_model, CVPropagationModel)
    predicted = policy.predicted_cv(snap(12.0))
    assert len(predicted) == 3 and all(v >= 0 for v in predicted)
