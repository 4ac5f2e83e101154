"""Baseline policies and the CV-propagation model on scripted snapshots."""

from __future__ import annotations

import random

import pytest
from gateway_plugin.policies import make_policy
from gateway_plugin.policies.cv_model import load_cv_model, save_cv_model, train_cv_model
from gateway_plugin.snapshot import PipelineSnapshot, StageSnapshot


def st(i: int, **kw) -> StageSnapshot:
    base = dict(name=f"m-stage-{i}", index=i, arrival_rate=1.0, service_rate=2.0, replicas=1, max_replicas=20)
    base.update(kw)
    return StageSnapshot(**base)


def snap(t: float, *stages: StageSnapshot) -> PipelineSnapshot:
    return PipelineSnapshot(time=t, model="m", stages=tuple(stages))


def test_static_holds_its_count() -> None:
    p = make_policy("static", replicas=3)
    assert [d.replicas for d in p.decide(snap(0, st(0, arrival_rate=100), st(1))).stages] == [3, 3]


def test_openfaas_ce_fires_after_for_and_resolves_to_min() -> None:
    p = make_policy("openfaas-ce")
    hot = st(0, arrival_rate=8.0, replicas=1, min_replicas=1, max_replicas=10)
    assert p.decide(snap(0, hot)).stages[0].replicas == 1  # pending, not firing yet
    assert p.decide(snap(5, hot)).stages[0].replicas == 3  # fired: +20 % of 10
    assert p.decide(snap(6, hot)).stages[0].replicas == 3  # not re-sent before group_interval
    assert p.decide(snap(15, hot)).stages[0].replicas == 5
    assert p.decide(snap(16, st(0, arrival_rate=1.0, replicas=5, max_replicas=10))).stages[0].replicas == 1


def test_knative_panics_on_burst_and_never_scales_down_in_panic() -> None:
    p = make_policy("knative-kpa")
    for t in range(30):
        p.decide(snap(t, st(0, busy=1, replicas=2)))
    burst = p.decide(snap(30, st(0, busy=2, queue_len=20, replicas=2))).stages[0]
    assert burst.replicas >= 2 * 2 and "panic" in burst.reason
    calm = p.decide(snap(40, st(0, busy=0, queue_len=0, replicas=burst.replicas))).stages[0]
    assert calm.replicas == burst.replicas
    later = p.decide(snap(200, st(0, busy=0, queue_len=0, replicas=burst.replicas))).stages[0]
    assert later.replicas < burst.replicas and "stable" in later.reason


def test_inferline_scales_each_stage_by_its_own_rate_and_down_conservatively() -> None:
    p = make_policy("inferline")
    d = p.decide(snap(0, st(0, arrival_rate=8.0, service_rate=2.0), st(1, arrival_rate=1.0, service_rate=2.0)))
    assert d.stages[0].replicas == 5 and d.stages[1].replicas == 1  # 8 / (2 × 0.8)
    for t in range(1, 10):
        d = p.decide(snap(t, st(0, arrival_rate=0.5, service_rate=2.0, replicas=5), st(1)))
        assert d.stages[0].replicas == 5  # envelope over 30 s still remembers the peak
    replicas, first_down = 5, None
    for t in range(10, 80):
        d = p.decide(snap(t, st(0, arrival_rate=0.5, service_rate=2.0, replicas=replicas), st(1)))
        if d.stages[0].replicas < replicas and first_down is None:
            first_down = t
        replicas = d.stages[0].replicas
    assert replicas == 1 and first_down is not None and first_down >= 30  # after the 30-s envelope forgets 8 rps


def test_whole_model_policies_scale_every_stage_together() -> None:
    stages = (st(0, arrival_rate=4.0, service_rate=4.0), st(1, arrival_rate=4.0, service_rate=1.0), st(2, service_rate=4.0))
    infless = make_policy("infless").decide(snap(0, *stages))
    counts = {d.replicas for d in infless.stages}
    assert len(counts) == 1 and counts.pop() == 8  # 4 rps × 1.5 s per request / 0.8
    cocktail = make_policy("cocktail").decide(snap(0, *stages))
    counts = {d.replicas for d in cocktail.stages}
    assert len(counts) == 1 and counts.pop() == 5  # 4 × 1.2 / 1 (bottleneck stage)


def test_cv_model_learns_propagation_and_roundtrips(tmp_path) -> None:
    rng = random.Random(0)
    series = []
    cvs = [1.0] * 4
    for t in range(200):
        # a burst enters stage 0 and reaches stage i one window later, damped: CV_i(t) = 0.6·CV_{i−1}(t−1) + 0.2
        cvs = [rng.uniform(0.5, 4.0)] + [0.6 * cvs[i - 1] + 0.2 for i in range(1, 4)]
        stages = [st(i, cv_arrival=cvs[i], utilisation=0.5) for i in range(4)]
        series.append(snap(float(t), *stages))
    model, loss = train_cv_model(series, horizon=1, epochs=200)
    baseline = sum((a.cv_arrival - b.cv_arrival) ** 2 for s0, s1 in zip(series, series[1:], strict=False) for a, b in zip(s0.stages, s1.stages, strict=True))
    baseline /= (len(series) - 1) * 4
    assert loss < baseline  # better than "CV stays as observed"
    assert model.theta.requires_grad
    path = tmp_path / "cv.safetensors"
    save_cv_model(model, str(path))
    again = load_cv_model(str(path))
    assert again.predict(series[-1]) == pytest.approx(model.predict(series[-1]), rel=1e-6)
    quart = make_policy("quart", cv_model=again)
    assert len(quart.decide(series[-1]).stages) == 4
