"""The simulator's generation experiments: `--experiment generation` (TTFT/TPOT SLO attainment per policy beside
the static frontier and the oracle, issue 32 item 7), `--experiment paraserve` and `--experiment blitzscale
--workload generation` (issue 29). A small synthetic trace (the Azure columns) keeps them to seconds."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import numpy as np
import pytest
from quart_tools.sim.blitzscale import MODES as BLITZ_MODES
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.cli import main
from quart_tools.sim.genexp import run_generation
from quart_tools.sim.paraserve import MODES as PARASERVE_MODES
from quart_tools.sim.paraserve import run_paraserve

GEN_KEYS = {"mode", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tbt_p99_ms", "steady_tbt_p99_ms",
            "ttft_slo_attainment", "tpot_slo_attainment", "kv_migrations"}


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    """Ten minutes of an Azure-shaped trace: Poisson arrivals, prompts of 200–2,000 tokens, outputs of 5–60."""
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("trace") / "trace.csv"
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    at = np.cumsum(rng.exponential(0.5, 1200))
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"{(t0 + timedelta(seconds=float(s))).strftime('%Y-%m-%d %H:%M:%S.%f')},{rng.integers(200, 2000)},"
              f"{rng.integers(5, 60)}" for s in at]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_paraserve_rows_on_the_same_sessions(trace: str) -> None:
    doc = run_paraserve(["llama2-7b"], Calibration(), trace, warm_s=10.0, burst_s=10.0, cool_s=20.0)
    rows = {r["mode"]: r for r in doc["rows"]}
    assert set(rows) == set(PARASERVE_MODES)
    assert all(GEN_KEYS <= set(r) for r in rows.values())
    assert len({r["requests"] for r in rows.values()}) == 1  # the same burst for every mode
    assert all(r["completed"] == r["requests"] for r in rows.values())
    assert "fork" in rows["allcache"]["starts"] and "cold" in rows["registry-cold"]["starts"]
    assert "paraserve" in rows["paraserve"]["starts"]  # the planner split the cold starts over P hosts
    assert rows["paraserve"]["paraserve_parts"] and doc["fabric"]["nic_gbit_s"] == 16.0


def test_blitzscale_generation_through_the_cli(trace: str, tmp_path) -> None:
    out = tmp_path / "blitz-gen.json"
    assert main(["--experiment", "blitzscale", "--workload", "generation", "--models", "llama2-7b", "--trace", trace,
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["mode"]: r for r in doc["rows"]}
    assert doc["workload"] == "generation" and set(rows) == set(BLITZ_MODES)
    assert all(GEN_KEYS <= set(r) for r in rows.values())
    check = doc["checks"]["llama2-7b"]
    assert {"live_ttft_p99_over_peer_fetch", "live_tbt_p99_over_steady", "met"} <= set(check)
    assert rows["live"]["ttft_p99_ms"] < rows["registry-cold"]["ttft_p99_ms"]


def test_generation_frontier_and_oracle(trace: str) -> None:
    doc = run_generation(["opt-66b"], [1.0], False, 20.0, 0.4, Calibration(), trace, [0], workers=1,
                         policies=("quart",))
    policies = {e["policy"] for e in doc["entries"]}
    assert {"quart", "oracle", "static-1"} <= policies
    [row] = doc["summary"]
    assert row["workload"] == "opt-66b/cv1" and row["frontier"] in ("interpolated", "clamped",
                                                                      "below the cheapest static")
    oracle = next(e for e in doc["entries"] if e["policy"] == "oracle")
    assert oracle["oracle"]["budget_replica_seconds"] == row["quart_replica_seconds"]
    assert 0.0 <= row["quart"]["slo_attainment"] <= 1.0
    quart = next(e for e in doc["entries"] if e["policy"] == "quart")
    assert quart["completed"] == quart["requests"] > 0 and quart["ttft_slo_ms"] > quart["tpot_slo_ms"] > 0


def test_a_trace_window_carries_each_request_s_output_length(trace: str) -> None:
    from quart_tools.arrivals import load_trace, trace_window

    t = load_trace(trace)
    w = trace_window(t, 60.0, 120.0, target_rate=4.0, seed=1)  # about 2 × the trace's rate: copies
    pairs = set(zip(t.context_tokens.tolist(), t.generated_tokens.tolist(), strict=True))
    assert w.generated is not None and len(w.generated) == len(w.tokens) == len(w)
    assert all((c, g) in pairs for c, g in zip(w.tokens.tolist(), w.generated.tolist(), strict=True))
