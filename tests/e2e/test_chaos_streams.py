"""`quartctl bench chaos` stream scenarios (issue 31, item 7): concurrent token streams of the ``tiny`` decoder
through a real `quartctl up` (2 KeysManager hosts, real CPU stage replicas) while a stage replica holding their
sessions is ``kill -9``'d and the gateway is restarted: every stream completes with the undisturbed run's tokens
or ends with an error the client sees; none hangs. And the catalog that the first concurrent streams hit
loads a model's tokenizer once."""

from __future__ import annotations

import asyncio
import threading
import time

from gateway_plugin.generation import tokens
from quart_tools.bench.chaos import SCENARIOS
from quart_tools.bench.chaos_streams import STREAM_SCENARIOS, stream_scenarios, summary


def test_stream_scenarios_end_every_stream_and_keep_the_tokens(tmp_path):
    assert set(STREAM_SCENARIOS) <= set(SCENARIOS)
    got = asyncio.run(stream_scenarios(tmp_path, ["stream-replica-kill", "stream-gateway-kill"], streams=4,
                                       new_tokens=24, timeout_s=60.0, seed=3))
    assert [s["name"] for s in got] == ["stream-replica-kill", "stream-gateway-kill"]
    for s in got:
        assert s["streams_started"] == 4 and s["stream_hangs"] == 0, s
        assert s["streams_completed"] + s["stream_errors"] == s["streams_started"], s
        assert s["streams_identical"] == s["streams_completed"], s
        assert s["serving_again"], s
    kill = got[0]
    assert kill["sessions_on_it"] and kill["tokens_at_fault"] >= 4 * 3  # it hit streams in flight
    assert kill["streams_completed"] == 4  # the other stage-1 replica takes them over: replay, same tokens


def test_the_summary_counts_a_wrong_token_and_a_closed_stream():
    results = [{"outcome": "completed", "tokens": [1, 2], "error": None, "closed": False},
               {"outcome": "completed", "tokens": [1, 3], "error": None, "closed": False},
               {"outcome": "error", "tokens": [1], "error": "connection closed before [DONE]", "closed": True},
               {"outcome": "hang", "tokens": [], "error": None, "closed": False}]
    got = summary("x", results, [[1, 2]] * 4, {})
    assert (got["streams_completed"], got["streams_identical"], got["stream_errors"], got["stream_closed"],
            got["stream_hangs"]) == (2, 1, 1, 1, 1)


def test_concurrent_first_requests_load_a_model_once(tmp_path, monkeypatch):
    (tmp_path / "manifest.json").write_text("{}")
    calls, active, overlap = [], [0], [False]
    lock = threading.Lock()

    def slow_load(name: str, model_dir: str):
        with lock:
            active[0] += 1
            overlap[0] |= active[0] > 1
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        calls.append(name)
        return name

    monkeypatch.setattr(tokens, "load_model", slow_load)

    async def many():
        catalog = tokens.ModelCatalog()
        return await asyncio.gather(*(catalog.get("m", str(tmp_path)) for _ in range(8)))

    assert asyncio.run(many()) == ["m"] * 8 and calls == ["m"] and not overlap[0]
