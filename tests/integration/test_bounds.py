"""Issue 31 item 1: every input bounded before it is expanded; a replica's memory bounded.

A 4 MB ``text`` drove a stage replica to 7.2 GB while tokenizing it before its 256-token check: the
characters are now counted first (413 naming ``QUART_MAX_TEXT_CHARS``), and a replica serves under
``RLIMIT_DATA`` (:mod:`quart_stage.memlimit`), so an allocation past its headroom fails in the replica.
"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest
from quart_stage.config import StageConfig
from quart_stage.errors import QuartError
from quart_stage.inputs import CHARS_PER_POSITION, check_text, text_limit
from quart_stage.memlimit import headroom_bytes
from quart_stage.runtime import StageRuntime

JSON = {"Content-Type": "application/json"}


def test_a_4mb_text_is_refused_413_before_the_tokenizer_sees_it(tiny1):  # noqa: F811
    rt = StageRuntime.load(StageConfig(model_dir=tiny1, stage_index=0, num_stages=1))
    assert rt.handle(json.dumps({"text": "hello"}).encode(), JSON).status == 200  # the tokenizer is loaded
    proc = psutil.Process()
    before = proc.memory_info().rss
    res = rt.handle(json.dumps({"text": "a " * (2 << 20)}).encode(), JSON)  # refused by its size, unparsed
    doc = json.loads(res.body)
    assert res.status == 413 and doc["field"] == "body" and "QUART_MAX_TEXT_CHARS" in doc["error"], doc
    res = rt.handle(json.dumps({"text": "a " * 50_000}).encode(), JSON)  # parsed, then refused by its length
    growth_mb = (proc.memory_info().rss - before) / 2**20
    doc = json.loads(res.body)
    assert res.status == 413 and doc["field"] == "text" and "QUART_MAX_TEXT_CHARS" in doc["error"], doc
    assert growth_mb <= 64, growth_mb


def test_ids_are_bounded_by_shape_before_a_tensor_is_allocated(tiny1):  # noqa: F811
    rt = StageRuntime.load(StageConfig(model_dir=tiny1, stage_index=0, num_stages=1, max_batch=4))
    res = rt.handle(json.dumps({"input_ids": [[1]] * 5}).encode(), JSON)
    assert res.status == 400 and "batch size must be 1..4" in json.loads(res.body)["error"]
    too_long = rt.shape.max_seq + 1
    res = rt.handle(json.dumps({"input_ids": [[1] * too_long]}).encode(), JSON)
    assert res.status == 400 and f"got {too_long}" in json.loads(res.body)["error"]


def test_the_text_limit_counts_a_whole_batch_and_follows_the_model():
    cfg = StageConfig(compute="emulated", profile="bert-21b")
    assert text_limit(cfg, 512) == CHARS_PER_POSITION * 512 and text_limit(cfg, None) == 65_536
    assert check_text(["ab", "cd"], cfg, 512) == ["ab", "cd"]
    with pytest.raises(QuartError) as err:
        check_text(["x" * 5000, "y" * 5000], cfg, 512)  # each fits, together they do not
    assert err.value.status == 413 and "10000 characters" in err.value.message
    with pytest.raises(QuartError) as err:
        check_text(["a"] * 65, cfg, 512)  # more texts than max_batch: refused before counting
    assert err.value.status == 400 and "batch size" in err.value.message
    assert text_limit(StageConfig(compute="emulated", profile="bert-21b", max_text_chars=10), 512) == 10


def test_headroom_defaults_from_the_parameter_bytes():
    assert headroom_bytes(0, 0) == 1 << 30
    assert headroom_bytes(0, 3 << 30) == 6 << 30
    assert headroom_bytes(123, 3 << 30) == 123 and headroom_bytes(-1, 0) is None


def test_a_bounded_replica_fails_an_allocation_past_its_headroom_instead_of_growing():
    code = ("from quart_stage.memlimit import bound_replica\n"
            "limit = bound_replica(64 << 20, 0)\n"
            "assert limit\n"
            "small = bytearray(16 << 20)\n"
            "try:\n"
            "    big = bytearray(512 << 20)\n"
            "except MemoryError:\n"
            "    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr
