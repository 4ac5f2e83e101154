"""Report math on records whose answers are known by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from quart_tools.loadgen import RequestRecord, write_records
from quart_tools.report import (
    StageSample,
    build_report,
    cv_by_stage,
    goodput_rps,
    latency_stats,
    main,
    queue_mean_by_stage,
    replica_seconds,
    slo_attainment,
)


def test_latency_stats_and_slo() -> None:
    lat = np.array([100.0, 150.0, 200.0, 300.0, math.nan])  # one failed request
    stats = latency_stats(lat)
    assert stats["mean_ms"] == pytest.approx(187.5)
    assert stats["p50_ms"] == pytest.approx(175.0)
    slo = slo_attainment(lat, profiled_ms=100.0)
    assert slo == {"1.0": 0.2, "1.5": 0.4, "2.0": 0.6, "2.5": 0.6, "3.0": 0.8}
    assert slo_attainment(lat[:4], 100.0, n_total=8)["3.0"] == 0.5
    assert goodput_rps(lat, 100.0, duration_s=2.0) == 1.0  # 100 and 150 ms meet 1.5 × 100 ms
    assert math.isnan(latency_stats([])["mean_ms"])
    with pytest.raises(ValueError):
        slo_attainment(lat, 0.0)


def test_step_integrals() -> None:
    samples = [StageSample(0.0, 0, 1, 0), StageSample(2.0, 0, 3, 4), StageSample(0.0, 1, 2, 1)]
    # stage 0: 1 replica for 2 s then 3 replicas for 2 s; stage 1: 2 replicas for 4 s
    assert replica_seconds(samples, end_s=4.0) == pytest.approx(2 + 6 + 8)
    q = queue_mean_by_stage(samples, end_s=4.0)
    assert q == {"0": pytest.approx(2.0), "1": pytest.approx(1.0)}
    rows = [{"t": 0, "stage": 0, "replicas": 1, "queue": 0}, {"t": 1, "stage": 0, "replicas": 5, "queue": 2}]
    assert replica_seconds(rows, end_s=2.0) == pytest.approx(6.0)


def test_cv_by_stage() -> None:
    cvs = cv_by_stage({0: np.arange(0, 100, 1.0), 1: [0.0, 0.1, 5.0, 5.1, 10.0, 10.1]})
    assert cvs["0"] == pytest.approx(0.0)
    assert cvs["1"] > 0.9


def test_build_report_keys() -> None:
    entry = build_report("quart", [10.0, 20.0], profiled_ms=10.0, duration_s=1.0,
                         samples=[StageSample(0.0, 0, 1, 0)], end_s=1.0)
    for key in ("policy", "mean_ms", "p50_ms", "p99_ms", "slo_attainment", "goodput_rps", "replica_seconds",
                "queue_mean_by_stage"):
        assert key in entry
    assert entry["replica_seconds"] == pytest.approx(1.0)
    assert set(entry["slo_attainment"]) == {"1.0", "1.5", "2.0", "2.5", "3.0"}


def test_cli_on_records(tmp_path, capsys) -> None:
    recs = [RequestRecord(i, i * 0.1, i * 0.1, 200, 100.0 + 50 * i, 10) for i in range(4)]
    recs.append(RequestRecord(4, 0.4, 0.4, 503, 1.0, 10))  # an error answer is not a success
    path = tmp_path / "quart.jsonl"
    write_records(recs, path)
    series = tmp_path / "ts.jsonl"
    series.write_text("\n".join(json.dumps({"t": t, "stage": 0, "replicas": 2, "queue": 1}) for t in (0, 0.4)))
    out = tmp_path / "report.json"
    assert main([f"quart={path}", "--profiled-ms", "100", "--timeseries", str(series), "--out", str(out),
                 "--plots", str(tmp_path / "plots")]) == 0
    doc = json.loads(out.read_text())
    assert doc[0]["policy"] == "quart"
    assert doc[0]["slo_attainment"]["1.0"] == pytest.approx(0.2)
    assert doc[0]["slo_attainment"]["3.0"] == pytest.approx(0.8)
    assert doc[0]["replica_seconds"] == pytest.approx(0.8)
    assert (tmp_path / "plots" / "latency-cdf.png").stat().st_size > 1000
    assert main([str(tmp_path / "nope.jsonl"), "--profiled-ms", "1"]) == 2
