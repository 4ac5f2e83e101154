"""`quartctl bench gateway` and `quartctl bench pipeline`: the JSON they write (fast), and the targets on a quiet
machine (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def run_bench(tmp_path, *args: str, bench: str = "gateway") -> dict:
    out = tmp_path / f"{bench}.json"
    res = subprocess.run([sys.executable, "-m", "quart_tools.cli", "bench", bench, "--out", str(out), *args],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_gateway_writes_the_figures(tmp_path):
    result = run_bench(tmp_path, "--requests", "200", "--warmup", "20", "--seconds", "0.5", "--connections", "4",
                       "--client", "python")
    for key in ("p50_added_ms", "p99_added_ms", "rps_gateway", "rps_direct", "p50_gateway_ms", "p50_direct_ms"):
        assert isinstance(result[key], float | int), key
    assert result["connections"] == 4 and result["client"].startswith("quart asyncio client")
    assert result["rps_gateway"] > 0 and result["rps_direct"] > 0
    assert result["p50_gateway_ms"] > result["p50_direct_ms"] > 0  # a hop costs something, never nothing
    assert result["body_bytes"] == 1024


@pytest.mark.slow
def test_bench_gateway_meets_its_targets(tmp_path):
    result = run_bench(tmp_path)
    assert result["p50_added_ms"] <= 1.0, result
    assert result["rps_gateway"] >= 1500, result
    assert result["rps_gateway"] >= 0.10 * result["rps_direct"], result


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (apt-get install wrk)")
def test_bench_gateway_with_wrk(tmp_path):
    result = run_bench(tmp_path, "--requests", "100", "--warmup", "10", "--seconds", "1", "--connections", "4",
                       "--client", "wrk")
    assert result["client"].startswith("wrk") and result["connections"] == 4
    assert result["rps_gateway"] > 0 and result["rps_direct"] > result["rps_gateway"]
    assert result["loaded"]["p50_gateway_ms"] > 0


def test_bench_pipeline_writes_the_figures(tmp_path):
    result = run_bench(tmp_path, "--stages", "2", "--requests", "100", "--warmup", "10", "--seconds", "0.5",
                       "--connections", "4", "--client", "python", bench="pipeline")
    for key in ("stages", "rps_single", "rps_pipeline", "p50_added_single_ms", "p50_added_per_stage_ms"):
        assert isinstance(result[key], float | int), key
    assert result["stages"] == 2 and result["rps_single"] > 0 and result["rps_pipeline"] > 0
    assert result["p50_pipeline_ms"] > result["p50_single_ms"] > result["p50_direct_ms"] > 0


@pytest.mark.slow
def test_bench_pipeline_meets_its_targets(tmp_path):
    result = run_bench(tmp_path, "--stages", "4", "--connections", "16", bench="pipeline")
    assert result["rps_pipeline"] * result["stages"] >= 0.8 * result["rps_single"], result
    assert result["p50_added_per_stage_ms"] <= 1.2 * result["p50_added_single_ms"], result


def test_bench_standalone_writes_the_figures(tmp_path):
    """The standalone plugin (its own process) in front of the embedded gateway vs the embedded path."""
    result = run_bench(tmp_path, "--stages", "2", "--requests", "60", "--warmup", "5", bench="standalone")
    for key in ("p50_added_per_stage_embedded_ms", "p50_added_per_stage_standalone_ms", "p50_added_single_ms",
                "ratio_standalone_vs_embedded"):
        assert isinstance(result[key], float | int), key
    assert result["stages"] == 2 and result["cpu_ms_per_request"]["standalone"] > 0
    # the standalone path is the embedded one plus a plugin process and a gateway hop per stage
    assert result["p50_standalone_ms"] > result["p50_embedded_ms"] > result["p50_direct_ms"] > 0


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="issue 40's target is not met: 2.99x measured (docs/plugin.md); the plugin pays a "
                                       "whole gateway hop per stage call, which only calling the pods removes")
def test_bench_standalone_meets_its_target(tmp_path):
    result = run_bench(tmp_path, bench="standalone")
    assert result["p50_added_per_stage_standalone_ms"] <= 2 * result["p50_added_per_stage_embedded_ms"], result
