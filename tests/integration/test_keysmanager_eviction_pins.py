"""Pinned zygotes in a live KeysManager (the scheduler's keep_cached made binding): the LRU takes unpinned
zygotes first, and the zygote a cold start leaves behind never displaces a pinned one."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from support.keysmanager import raw_post, stage, wait_for

from keysmanager.client import KeysManagerError


@pytest.fixture(scope="module")
def tiny():
    """A 2-stage tiny model with random weights."""
    from quart_tools.partition import partition

    root = Path(tempfile.mkdtemp(prefix="km-pins-", dir="/tmp"))
    try:
        partition("tiny", 2, str(root / "tiny"), weights="random", progress=False)
        yield root / "tiny"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_pins_are_set_read_and_validated_over_the_api(daemon):  # noqa: F811
    d = daemon("hv")
    assert d.client.pinned() == []
    assert d.client.pin(["b-stage-1", "a-stage-1", "a-stage-1"]) == ["a-stage-1", "b-stage-1"]
    assert d.client.pinned() == ["a-stage-1", "b-stage-1"]
    status, body = raw_post("/v1/pins", b'{"functions": ["a-stage-1"]}', d.socket)
    assert status == 405  # PUT replaces the set; there is no POST
    for bad in ({"functions": "a-stage-1"}, {"functions": ["../etc"]}, {"function": ["a"]}, [1]):
        with pytest.raises(KeysManagerError) as err:
            d.client._call("PUT", "/v1/pins", bad)
        assert err.value.status == 400 and err.value.field == "functions"
    assert d.client.pin([]) == [] and d.client.health()["name"] == "hv"
    assert d.client.pin(["a-stage-1"], sole=["a-stage-1", "c-stage-0"]) == ["a-stage-1"]  # sole copies: accepted
    for bad in ({"functions": [], "sole": "a"}, {"functions": [], "sole": ["../etc"]}):
        with pytest.raises(KeysManagerError) as err:
            d.client._call("PUT", "/v1/pins", bad)
        assert err.value.status == 400 and err.value.field == "sole"


@pytest.mark.slow  # ~15 s: zygote loads and a cold start of a real (tiny) model
def test_pinned_zygotes_survive_the_lru_and_the_cache_after_a_cold_start(daemon, tiny):  # noqa: F811
    one = json.loads((tiny / "manifest.json").read_text())["stages"][1]["file_bytes"]
    d = daemon("hp", "--memory-limit", str(int(2.5 * one)))  # two tiny stages, or one and a cold replica's copy
    a, b, c, e = (stage(tiny, 1, function=f"{n}-stage-1") for n in "abce")
    d.client.ensure_cached(a)
    d.client.ensure_cached(b)
    assert d.client.pin(["a-stage-1", "a-stage-1"]) == ["a-stage-1"]
    d.client.ensure_cached(c)  # needs room: b goes although a is least recently used (a is pinned)
    assert d.client.report().cached == ["a-stage-1", "c-stage-1"]
    d.client.invalidate("c-stage-1")

    [cold] = d.client.start(e, 1)  # cold start (no zygote of e); caching e afterwards would need an eviction
    assert cold.source == "cold" and cold.state == "ready"
    time.sleep(0.5)  # the cache-after-cold attempt runs in the background; it must give up, evicting nothing
    assert d.client.report().cached == ["a-stage-1"]
    assert d.client.pinned() == ["a-stage-1"]

    d.client.ensure_cached(e)  # an explicit cache request may still evict a pinned zygote (the last resort)
    assert d.client.report().cached == ["e-stage-1"]
    report = d.client.report()
    assert report.memory_used <= report.memory_limit
    d.client.stop(cold.id)
    wait_for(lambda: d.client.health(), what="the daemon still serving")

