"""`quartctl load --generate`: streamed generation requests with trace lengths against the generation API
(tests/support/generation_app.py: the gateway's generation engine over session-speaking fake stages of ``tiny``),
client-side TTFT/TPOT in the records, and `quartctl report`'s TTFT/TPOT percentiles and SLO attainment."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
from quart_tools.arrivals import DEFAULT_TRACE, load_trace, make_arrivals, poisson_arrivals
from quart_tools.genload import door_of, generation_stats, make_workload, read_stream, token_lengths
from quart_tools.loadgen import RequestRecord, generate_load, read_records, write_records
from quart_tools.loadgen import main as load_main
from quart_tools.report import main as report_main
from support.generation_app import GenerationServer, tiny_models

TRACE = DEFAULT_TRACE
STEP_S = 0.01  # each fake stage call takes this long: a decode step through 2 stages ≥ 20 ms


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = GenerationServer(tiny_models(tmp_path_factory.mktemp("models")))
    for fake in running.fakes:
        fake.delay_s = STEP_S
    try:
        yield running
    finally:
        running.close()


def test_token_lengths_scale_and_cap() -> None:
    prompt, new = token_lengths(np.array([4808, 100, 3]), np.array([10, 600, 0]), scale=0.1, max_context=256,
                                max_new_tokens=32)
    assert new.tolist() == [1, 32, 1]  # 10×0.1 = 1; 60 capped at 32; 0 → at least one token
    assert prompt.tolist() == [255, 10, 1]  # 481 capped so that prompt + new ≤ 256
    assert (prompt + new <= 256).all()
    with pytest.raises(ValueError, match="scale"):
        token_lengths(np.array([1]), np.array([1]), scale=0)
    prompt, new = token_lengths(np.array([1000]), np.array([10]), scale=0.01, output_scale=2.0, max_context=256)
    assert (prompt.tolist(), new.tolist()) == ([10], [20])
    assert door_of("http://h:1/v1/completions") == "completions"
    assert door_of("http://h:1/function/tiny") == "function"
    with pytest.raises(ValueError, match="v1/completions"):
        door_of("http://h:1/v1/chat")


@pytest.mark.skipif(not TRACE.is_file(), reason="the Azure trace is not in ../shared/traces")
def test_trace_lengths_follow_the_trace_columns() -> None:
    trace = load_trace(TRACE)
    arrivals = make_arrivals("trace", rate=50.0, duration_s=2.0, trace_path=TRACE)
    assert arrivals.generated is not None and len(arrivals.generated) == len(arrivals)
    n = len(arrivals)
    assert arrivals.tokens.tolist() == trace.context_tokens[:n].tolist()
    assert arrivals.generated.tolist() == trace.generated_tokens[:n].tolist()
    work = make_workload("http://h/v1/completions", arrivals, model="m", scale=0.05, max_context=256,
                         max_new_tokens=16)
    want_prompt, want_new = token_lengths(trace.context_tokens[:n], trace.generated_tokens[:n], scale=0.05,
                                          max_context=256, max_new_tokens=16)
    assert work.prompt_tokens.tolist() == want_prompt.tolist()
    assert work.max_tokens.tolist() == want_new.tolist()
    body = json.loads(work.request(0)[0])
    assert len(body["prompt"]) == want_prompt[0] and body["max_tokens"] == want_new[0] and body["stream"]


@pytest.mark.parametrize("path", ["/v1/completions", "/function/tiny"])
def test_load_streams_and_measures_ttft_tpot(server, path, tmp_path) -> None:
    arrivals = poisson_arrivals(20.0, 1.0, seed=3)
    url = server.url + path
    work = make_workload(url, arrivals, model="tiny", prompt_tokens=12, new_tokens=6, max_context=256)
    result = generate_load(url, arrivals, timeout_s=20.0, max_run_s=40.0, generation=work)
    assert len(result.records) == len(arrivals) > 5
    for rec in result.records:
        assert rec.ok, (rec.status, rec.error)
        assert rec.prompt_tokens == 12 and rec.max_tokens == 6 and rec.tokens == 6
        # the prefill and every decode step pass both stages (STEP_S each)
        assert 2 * STEP_S * 1000 * 0.9 <= rec.ttft_ms <= rec.latency_ms
        assert rec.tpot_ms >= 2 * STEP_S * 1000 * 0.9
        assert rec.ttft_ms + 5 * rec.tpot_ms <= rec.latency_ms + 1.0
    path_out = tmp_path / "gen.jsonl"
    write_records(result.records, path_out)
    back = read_records(path_out)
    assert [r.ttft_ms for r in back] == [r.ttft_ms for r in result.records]


def test_cli_generation_run_and_bad_requests(server, tmp_path, capsys) -> None:
    out = tmp_path / "r.jsonl"
    assert load_main([server.url + "/v1/completions", "--generate", "--model", "tiny", "--rate", "10",
                      "--duration", "0.5", "--prompt-tokens", "8", "--new-tokens", "3", "--timeout", "20",
                      "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] == summary["requests"] > 0 and summary["ttft_p50_ms"] > 0
    # an unknown model: each request ends with the gateway's 404, recorded as a failure, and the run exits 1
    capsys.readouterr()
    assert load_main([server.url + "/v1/completions", "--generate", "--model", "nope", "--rate", "10",
                      "--duration", "0.3", "--out", str(out)]) == 1
    assert "requests failed" in capsys.readouterr().err
    recs = read_records(out)
    assert recs and all(r.status == 404 and not r.ok and r.ttft_ms is None for r in recs)
    assert load_main([server.url + "/v1/completions", "--generate", "--duration", "0.3"]) == 2  # no --model


def test_read_stream_error_event_and_truncation() -> None:
    async def read(payload: bytes, door: str):
        reader = asyncio.StreamReader()
        reader.feed_data(payload)
        reader.feed_eof()
        return await read_stream(reader, door, 0.0)

    ok = asyncio.run(read(b'data: {"token": 5, "text": "a"}\n\ndata: {"token": 6, "text": "b"}\n\n'
                          b'data: {"finish_reason": "length", "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n',
                          "function"))
    assert ok.error is None and ok.tokens == 2 and ok.ttft_ms > 0
    failed = asyncio.run(read(b'data: {"choices": [{"text": "x"}]}\n\ndata: {"error": {"message": "no replica"}}\n\n'
                              b"data: [DONE]\n\n", "completions"))
    assert failed.tokens == 1 and "no replica" in failed.error
    cut = asyncio.run(read(b'data: {"choices": [{"text": "x"}]}\n\n', "completions"))
    assert "DONE" in cut.error
    # a token whose text was held back arrives with the finishing chunk: that is its time
    held = asyncio.run(read(b'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\n'
                            b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n',
                            "completions"))
    assert held.error is None and held.tokens == 1 and held.ttft_ms > 0 and held.tpot_ms is None


def test_generation_stats_known_answers() -> None:
    ttft = [100.0, 200.0, 300.0, 400.0, math.nan]
    tpot = [10.0, 20.0, math.nan, 40.0, math.nan]  # the third streamed one token: no TPOT
    ok = [True, True, True, True, False]
    stats = generation_stats(ttft, tpot, ok, ttft_slo_ms=250.0, tpot_slo_ms=25.0)
    assert stats["ttft_p50_ms"] == pytest.approx(250.0)
    assert stats["ttft_p99_ms"] == pytest.approx(397.0)
    assert stats["tpot_p50_ms"] == pytest.approx(20.0)
    assert stats["ttft_slo_attainment"] == pytest.approx(0.4)  # 2 of 5 (the failure misses)
    assert stats["tpot_slo_attainment"] == pytest.approx(0.6)  # 10, 20 and the one-token stream
    assert stats["slo_attainment"] == pytest.approx(0.4)
    assert stats["completed"] == 4
    assert "slo_attainment" not in generation_stats(ttft, tpot, ok)
    with pytest.raises(ValueError, match="TTFT"):
        generation_stats(ttft, tpot, ok, ttft_slo_ms=0.0)


def test_report_cli_on_generation_records(tmp_path, capsys) -> None:
    recs = [RequestRecord(i, i * 0.1, i * 0.1, 200, 500.0, 40, prompt_tokens=10, max_tokens=8, tokens=8,
                          ttft_ms=50.0 * (i + 1), tpot_ms=5.0 * (i + 1)) for i in range(4)]
    recs.append(RequestRecord(4, 0.4, 0.4, 200, 90.0, 40, error="stream error event: boom", prompt_tokens=10,
                              max_tokens=8, tokens=1, ttft_ms=10.0))  # a stream that broke: a miss
    path = tmp_path / "gen.jsonl"
    write_records(recs, path)
    assert report_main([f"quart={path}", "--profiled-ms", "500", "--ttft-slo-ms", "100", "--tpot-slo-ms", "15",
                        "--plots", str(tmp_path / "plots"), "--out", str(tmp_path / "rep.json")]) == 0
    gen = json.loads((tmp_path / "rep.json").read_text())[0]["generation"]
    assert gen["ttft_slo_attainment"] == pytest.approx(0.4)  # 50 and 100 ms of 5 requests
    assert gen["tpot_slo_attainment"] == pytest.approx(0.6)  # 5, 10, 15 ms
    assert gen["slo_attainment"] == pytest.approx(0.4)
    assert gen["ttft_p50_ms"] == pytest.approx(125.0)
    assert (tmp_path / "plots" / "ttft-tpot-cdf.png").stat().st_size > 1000
    # one-shot records have no generation block
    write_records([RequestRecord(0, 0.0, 0.0, 200, 5.0, 1)], path)
    assert report_main([str(path), "--profiled-ms", "5", "--out", str(tmp_path / "one.json")]) == 0
    assert "generation" not in json.loads((tmp_path / "one.json").read_text())[0]
