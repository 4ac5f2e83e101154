"""`quartctl bench chaos`: its fuzz cases are seeded and reach every API it claims to fuzz; the bench is listed."""

from __future__ import annotations

import random

from quart_tools.bench import BENCHMARKS
from quart_tools.bench.chaos_fuzz import _case


def test_fuzz_cases_are_seeded_and_cover_deploy_scale_function_and_async():
    assert [_case(random.Random(7)) for _ in range(3)] == [_case(random.Random(7)) for _ in range(3)]
    rng = random.Random(14)
    apis = {"/".join(_case(rng)[1].split("/")[:3]).rsplit("-", 1)[0] for _ in range(400)}
    assert {"/system/functions", "/system/scale", "/function/bert", "/async-function/bert"} <= apis
    assert "chaos" in BENCHMARKS
