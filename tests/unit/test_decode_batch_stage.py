"""Batched decode steps on stage replicas (quart_stage.sessionbatch, quart_stage.ragged; docs/generation.md
#batched-decode-steps): sessions of different lengths stepping together give the tokens of unbatched steps for
every decoder family and for SmolLM2 (real weights), seeded sampling stays per session, a session's 409 / 429 /
400 is its own answer while the others step, and a malformed batch is a 400 naming ``batch``."""

from __future__ import annotations

import json

import pytest
import torch
from quart_stage import batchwire, wire
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_tools.partition import partition, split_layers
from quart_tools.stagechain import (
    batched_step,
    cut_runtimes,
    generate,
    generate_batched,
    session_step,
    whole_tensors,
)

_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=128,
             max_position_embeddings=64)
CONFIGS = {  # sliding windows of 4: most prompts exceed them
    "llama": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True, **_BASE),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=4, **_BASE),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                  max_window_layers=2, **_BASE),
    "opt": dict(model_type="opt", ffn_dim=64, word_embed_proj_dim=32,
                **{k: v for k, v in _BASE.items() if k != "intermediate_size"}),
}
PROMPTS = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 2, 14, 6, 3)]
NEW = [10, 4, 12, 1, 7]  # sessions leave the batch at different steps


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("batched")
    out = {}
    for family, cfg in CONFIGS.items():
        for n in (1, 3):
            out[family, n] = str(root / f"{family}-{n}")
            partition({**cfg, "_name": family}, n, out[family, n], progress=False, seed=11, std=0.5)
    return out


def _runtimes(d: str, **settings) -> list[StageRuntime]:
    n = len(json.loads(open(f"{d}/manifest.json").read())["stages"])
    return [StageRuntime.load(StageConfig(model_dir=d, stage_index=i, **settings)) for i in range(n)]


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("n", [1, 3])
def test_batched_decode_steps_give_the_unbatched_tokens(models, family, n):
    runtimes = _runtimes(models[family, n])
    alone = [generate(runtimes, p, k, session=f"a{i}").tokens for i, (p, k) in enumerate(zip(PROMPTS, NEW, strict=True))]
    assert generate_batched(runtimes, PROMPTS, NEW) == alone
    assert runtimes[0].generation.table.used == 0  # every session freed with its last step


def test_seeded_sampling_in_a_batch_is_each_sessions_own(models):
    runtimes = _runtimes(models["llama", 3])
    samples = [{"temperature": 0.9, "seed": 5 + i, "top_k": 20 * (i % 2)} for i in range(len(PROMPTS))]
    alone = [generate(runtimes, p, k, session=f"a{i}", sample=s).tokens
             for i, (p, k, s) in enumerate(zip(PROMPTS, NEW, samples, strict=True))]
    assert generate_batched(runtimes, PROMPTS, NEW, samples=samples) == alone


def test_emulated_batched_steps_give_the_unbatched_tokens():
    def pipeline():
        return [StageRuntime.load(StageConfig(compute="emulated", profile="llama-7b", num_stages=3, stage_index=i,
                                              emulated_decode_ms=0.5, emulated_prefill_ms_per_token=0.01,
                                              emulated_cv=0.0, seed=1)) for i in range(3)]

    alone = [generate(pipeline(), p, k).tokens for p, k in zip(PROMPTS, NEW, strict=True)]
    assert generate_batched(pipeline(), PROMPTS, NEW) == alone


def _prefill(runtimes, sid: str, prompt: list[int], reserve: int = 0) -> tuple[int, int]:
    doc = json.loads(session_step(runtimes, prompt, 0, sid, reserve=reserve).body)
    return doc["token"], doc["pos"]


def test_one_sessions_409_and_400_are_its_own_and_the_others_step(models):
    runtimes = _runtimes(models["llama", 3])
    good = {sid: _prefill(runtimes, sid, p) for sid, p in (("g1", PROMPTS[0]), ("g2", PROMPTS[3]))}
    stale = _prefill(runtimes, "stale", PROMPTS[1])
    odd = _prefill(runtimes, "odd", PROMPTS[4])
    runtimes[1].generation.table.drop("g2")  # the middle stage lost g2: it answers 409 there, after stage 0 ran it
    steps = [("g1", *good["g1"]), ("ghost", 5, 4), ("stale", stale[0], stale[1] + 1), ("g2", *good["g2"]),
             ("odd", *odd)]
    results = batched_step(runtimes, steps, samples={"odd": {"temperature": -1}})
    by = {r["id"]: r for r in results}
    assert [r["id"] for r in results] == [s[0] for s in steps]
    assert by["ghost"]["status"] == 409 and by["ghost"]["held"] == 0 and by["ghost"]["field"] == "session"
    assert by["stale"]["status"] == 409 and by["stale"]["held"] == stale[1]
    assert by["g2"]["status"] == 409 and by["g2"]["held"] == 0
    assert by["odd"]["status"] == 400 and by["odd"]["field"] == "sample"
    assert runtimes[2].generation.table.held("odd") == len(PROMPTS[4])  # refused before anything changed
    ref = generate(_runtimes(models["llama", 3]), PROMPTS[0], 2, session="r").tokens
    assert by["g1"]["status"] == 200 and by["g1"]["token"] == ref[1] and by["g1"]["pos"] == len(PROMPTS[0]) + 1


def test_a_full_replica_refuses_one_session_with_429_and_steps_the_other(models):
    runtimes = _runtimes(models["llama", 1], kv_max_tokens=30)
    a = _prefill(runtimes, "a", PROMPTS[0], reserve=len(PROMPTS[0]) + 5)  # reserved: its steps never 429
    b = _prefill(runtimes, "b", PROMPTS[2])  # unreserved: its next position does not fit
    runtimes[0].generation.table.max_tokens = runtimes[0].generation.table.used
    ra, rb = batched_step(runtimes, [("a", *a), ("b", *b)])
    assert ra["status"] == 200 and rb["status"] == 429 and rb["field"] == "kv_cache" and rb["retry_after"] >= 1
    assert runtimes[0].generation.table.held("b") == len(PROMPTS[2])  # nothing changed for b


def _raw(rt: StageRuntime, table: list[dict], rows: torch.Tensor, count: int | str | None = None):
    body = wire.encode_bytes({"input_ids": rows}, {batchwire.META_SESSIONS: json.dumps(table)})
    return rt.handle(body, {batchwire.H_SESSION_BATCH: str(len(table) if count is None else count),
                            "Content-Type": wire.CONTENT_TYPE})


@pytest.mark.parametrize("table,rows,count,words", [
    ([{"id": "a", "pos": 3}], [[1]], 65, "from 1 to 64"),
    ([{"id": "a", "pos": 3}], [[1]], "x", "session count"),
    ([{"id": "a", "pos": 3}], [[1]], 2, "list of 2"),
    ([{"id": "a", "pos": 3}, {"id": "a", "pos": 4}], [[1], [2]], None, "twice"),
    ([{"id": "a", "pos": 0}], [[1]], None, "prefill goes alone"),
    ([{"id": "a b", "pos": 3}], [[1]], None, "id must be"),
    ([{"id": "a", "pos": 3, "extra": 1}], [[1]], None, "must be an object"),
    ([{"id": "a", "pos": 3}, {"id": "b", "pos": 3}], [[1]], None, "shape"),
])
def test_a_malformed_batch_is_400_naming_batch(models, table, rows, count, words):
    [rt] = _runtimes(models["llama", 1])
    resp = _raw(rt, table, torch.tensor(rows), count)
    doc = json.loads(resp.body)
    assert resp.status == 400 and words in doc["error"], doc
    assert doc["field"] in ("batch", "input_ids")


def test_an_encoder_refuses_a_batched_step(tmp_path):
    partition("tiny-encoder", 1, str(tmp_path / "enc"), progress=False)
    rt = StageRuntime.load(StageConfig(model_dir=str(tmp_path / "enc")))
    resp = _raw(rt, [{"id": "a", "pos": 3}], torch.tensor([[1]]))
    assert resp.status == 400 and json.loads(resp.body)["field"] == "session"


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    manifest, tensors = whole_tensors(smollm2_dir)
    bounds = split_layers(manifest.layer_parameter_counts, 3, manifest.method)
    return cut_runtimes(smollm2_dir, manifest, tensors, bounds)


def test_smollm2_batched_greedy_tokens_equal_unbatched(smollm2):
    prompts = [torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (40, 7, 23, 31)]
    new = [12, 6, 12, 9]
    alone = [generate(smollm2, p, k, session=f"a{i}").tokens for i, (p, k) in enumerate(zip(prompts, new, strict=True))]
    assert generate_batched(smollm2, prompts, new) == alone
