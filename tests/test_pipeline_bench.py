"""`quartctl bench pipeline`: the JSON it writes (fast), and the issue-26 targets on a quiet machine (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "pipeline.json"
    res = subprocess.run([sys.executable, "-m", "quart_tools.cli", "bench", "pipeline", "--out", str(out), *args],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_pipeline_writes_the_figures(tmp_path):
    result = run_bench(tmp_path, "--stages", "2", "--requests", "100", "--warmup", "10", "--seconds", "0.5",
                       "--connections", "4", "--client", "python")
    for key in ("stages", "rps_single", "rps_pipeline", "p50_added_single_ms", "p50_added_per_stage_ms"):
        assert isinstance(result[key], float | int), key
    assert result["stages"] == 2 and result["rps_single"] > 0 and result["rps_pipeline"] > 0
    assert result["p50_pipeline_ms"] > result["p50_single_ms"] > result["p50_direct_ms"] > 0


@pytest.mark.slow
def test_bench_pipeline_meets_its_targets(tmp_path):
    result = run_bench(tmp_path, "--stages", "4", "--connections", "16")
    assert result["rps_pipeline"] * result["stages"] >= 0.8 * result["rps_single"], result
    assert result["p50_added_per_stage_ms"] <= 1.2 * result["p50_added_single_ms"], result
