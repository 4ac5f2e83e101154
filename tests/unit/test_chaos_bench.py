"""`quartctl bench chaos`: its fuzz cases are seeded and reach every API it claims to fuzz; the bench is listed."""

from __future__ import annotations

import random

from quart_tools.bench import BENCHMARKS
from quart_tools.bench.chaos_fuzz import _case


def test_fuzz_cases_are_seeded_and_cover_deploy_scale_function_and_async():
    assert [_case(random.Random(7)) for _ in range(3)] == [_case(random.Random(7)) for _ in range(3)]
    rng = random.Random(14)
    apis = {"/".join(_case(rng)[1].split("/")[:3]).rsplit("-", 1)[0] for _ in range(400)}
    assert {"/system/functions", "/system/scale", "/function/bert", "/async-function/bert", "/v1/completions",
            "/v1/chat"} <= apis
    assert "chaos" in BENCHMARKS


def test_the_deadline_summary_counts_sheds_as_answers_and_entry_refusals_out():
    from quart_tools.bench.chaos_limits import deadline_summary

    answers = [(200, 150.0, False), (200, 2500.0, False), (429, 3.0, False), (429, 900.0, True), (504, 2000.5, False),
               (400, 1.0, False)]
    got = deadline_summary(answers, sent=7, lost=1, deadline_ms=2000)
    assert got["refused_at_entry"] == 2 and got["admitted"] == 5  # the lost call counts as admitted
    assert got["within_deadline"] == 2 and got["ok_within"] == 1 and got["shed"] == 1


def test_the_chaos_bench_has_the_default_restart_and_fuzzes_encodings():
    from quart_tools.bench.chaos import SCENARIOS

    assert "gateway-restart-default" in SCENARIOS
    rng = random.Random(3)
    assert any("Content-Encoding" in _case(rng)[3] for _ in range(200))
