"""Generation sessions on stage replicas (docs/generation.md): per-stage KV caches give transformers' own greedy
``generate(use_cache=True)`` tokens (and logits) for every decoder family at 1, 2 and 3 stages and for SmolLM2;
409 on a position mismatch, 429 at the KV bound, idle expiry, seeded sampling, emulated sessions, bad input."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from quart_stage import sample_history, sampling, wire
from quart_stage.app import create_app
from quart_stage.config import StageConfig
from quart_stage.emulated import step_time_for
from quart_stage.kvcache import SessionTable
from quart_stage.manifest import Manifest
from quart_stage.runtime import StageRuntime
from quart_stage.verify import reference_model
from quart_tools.partition import partition, split_layers
from quart_tools.stagechain import cut_runtimes, generate, generate_batched, session_step, whole_tensors

_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=128,
             max_position_embeddings=64)
CONFIGS = {  # sliding windows of 4: the prompt alone exceeds them
    "llama": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True, **_BASE),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=4, **_BASE),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                  max_window_layers=2, **_BASE),  # layers 0-1 full attention, 2-3 sliding
    "opt": dict(model_type="opt", ffn_dim=64, word_embed_proj_dim=32,
                **{k: v for k, v in _BASE.items() if k != "intermediate_size"}),
}
STAGES = (1, 2, 3)
PROMPT = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(5)).tolist()
NEW = 14
LOGIT_TOL = 1e-4


def _partition(root, family: str, n: int) -> str:
    d = str(root / f"{family}-{n}")
    partition({**CONFIGS[family], "_name": family}, n, d, progress=False, seed=11, std=0.5)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    return {(family, n): _partition(root, family, n) for family in CONFIGS for n in STAGES}


@pytest.fixture(scope="module")
def references(models):
    """Each family's whole model and its greedy generate (KV cache): tokens and every step's logits."""
    out = {}
    for family in CONFIGS:
        model = reference_model(models[family, 1])
        with torch.inference_mode():
            gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, use_cache=True,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        out[family] = (gen.sequences[0, len(PROMPT):].tolist(), [x[0] for x in gen.logits])
    return out


def _runtimes(d: str, **settings) -> list[StageRuntime]:
    n = Manifest.load(d).num_stages
    return [StageRuntime.load(StageConfig(model_dir=d, stage_index=i, **settings)) for i in range(n)]


def _post(rt: StageRuntime, ids: list[int], pos: int, session: str = "s", **headers):
    body = json.dumps({"input_ids": [ids]}).encode()
    return rt.handle(body, {"Content-Type": "application/json", "X-Quart-Session": session,
                            "X-Quart-Session-Pos": str(pos), **headers})


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("n", STAGES)
def test_greedy_tokens_equal_transformers_generate(models, references, family, n):
    tokens, logits = references[family]
    assert len(set(tokens)) >= 3, "the random weights must give a non-degenerate sequence"
    got = generate(_runtimes(models[family, n]), PROMPT, NEW, logits=True)
    assert got.tokens == tokens
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, logits, strict=True)) <= LOGIT_TOL


@pytest.mark.parametrize("family", ["mistral", "opt"])
def test_chunked_prefill_gives_the_same_tokens(models, references, family):
    got = generate(_runtimes(models[family, 3]), PROMPT, NEW, chunk=4)
    assert got.tokens == references[family][0]


def test_sessions_on_one_replica_run_concurrently_and_stay_apart(models, references):
    runtimes = _runtimes(models["qwen2", 3])
    results: dict[int, list[int]] = {}

    def run(k: int) -> None:
        results[k] = generate(runtimes, PROMPT, NEW, session=f"c{k}").tokens

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(k) for k in range(4)] == [references["qwen2"][0]] * 4
    assert all(rt.generation.table.used == 0 for rt in runtimes), "the last step frees every session"


def test_one_sessions_concurrent_steps_run_one_at_a_time(models):
    (rt,) = _runtimes(models["opt", 1])
    assert _post(rt, PROMPT, 0).status == 200
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda: statuses.append(_post(rt, [4], len(PROMPT)).status)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(statuses) == [200, 409]  # the second waits for the first, then finds the position taken
    assert rt.generation.table.held("s") == len(PROMPT) + 1


def test_position_mismatch_is_409_and_changes_nothing(models, references):
    (rt,) = _runtimes(models["llama", 1])
    unknown = _post(rt, [1], 5, session="never")
    assert unknown.status == 409 and json.loads(unknown.body) == {**json.loads(unknown.body), "field": "session",
                                                                  "held": 0}
    assert unknown.headers["X-Quart-Session-Pos"] == "0"
    first = _post(rt, PROMPT, 0)
    assert first.status == 200 and json.loads(first.body)["token"] == references["llama"][0][0]
    stale = _post(rt, [3], 4)  # the gateway thinks the replica holds 4 positions; it holds 9
    assert stale.status == 409 and json.loads(stale.body)["held"] == len(PROMPT)
    assert stale.headers["X-Quart-Session-Pos"] == str(len(PROMPT))
    nxt = _post(rt, [json.loads(first.body)["token"]], len(PROMPT))  # nothing changed: the session goes on
    assert nxt.status == 200 and json.loads(nxt.body) == {"token": references["llama"][0][1], "pos": len(PROMPT) + 1}
    again = _post(rt, PROMPT, 0)  # Pos 0 restarts the session under the same id (a replay)
    assert json.loads(again.body)["token"] == references["llama"][0][0]
    assert again.headers["X-Quart-Session-Pos"] == str(len(PROMPT))
    assert rt.generation.table.used == len(PROMPT)


def test_kv_bound_is_429_with_retry_after_and_frees_on_end(models):
    (rt,) = _runtimes(models["llama", 1], kv_max_tokens=20)
    assert _post(rt, PROMPT, 0, session="a").status == 200
    assert _post(rt, PROMPT, 0, session="b").status == 200  # 18 of 20
    full = _post(rt, PROMPT, 0, session="c")
    assert full.status == 429 and full.headers["Retry-After"] == "1"
    assert json.loads(full.body)["field"] == "kv_cache" and full.headers["X-Quart-KV-Tokens"] == "18/20"
    assert _post(rt, [1], 9, session="a").status == 200 and _post(rt, [1], 10, session="a").status == 200
    step = _post(rt, [1], 11, session="a")  # 21 > 20: refused, nothing changed
    assert step.status == 429 and step.headers["X-Quart-Session-Pos"] == "11"
    assert rt.generation.table.drop("b") and rt.generation.table.used == 11  # DELETE /_/sessions/b
    end = _post(rt, [1], 11, session="a", **{"X-Quart-Session-End": "1"})
    assert end.status == 200 and end.headers["X-Quart-KV-Tokens"] == "0/20" and rt.generation.table.held("a") == 0
    assert _post(rt, PROMPT, 0, session="c").status == 200 and rt.generation.table.used == 9


def test_reserve_is_charged_at_entry(models):
    (rt,) = _runtimes(models["llama", 1], kv_max_tokens=20)
    assert _post(rt, PROMPT, 0, session="a", **{"X-Quart-Session-Reserve": "15"}).status == 200
    assert rt.generation.table.used == 15
    refused = _post(rt, PROMPT, 0, session="b")  # 15 + 9 > 20: refused at its entry
    assert refused.status == 429 and json.loads(refused.body)["field"] == "kv_cache"
    pos = len(PROMPT)
    for _ in range(6):  # session a's steps inside its reservation never wait for room
        assert _post(rt, [2], pos, session="a").status == 200
        pos += 1
    assert rt.generation.table.used == 15
    too_big = _post(rt, PROMPT, 0, session="c", **{"X-Quart-Session-Reserve": "21"})
    assert too_big.status == 400 and json.loads(too_big.body)["field"] == "kv_cache"
    assert rt.generation.table.drop("a") and rt.generation.table.used == 0


def test_idle_sessions_are_freed():
    now = [100.0]
    table = SessionTable(max_tokens=50, idle_s=10.0, clock=lambda: now[0], sweeper=False)
    with table.step("a", 0, 5, 0, dict):
        pass
    now[0] = 105.0
    with table.step("b", 0, 5, 0, dict):
        pass
    assert table.used == 10 and [s["id"] for s in table.snapshot()["sessions"]] == ["a", "b"]
    now[0] = 112.0
    assert table.sweep() == 1 and table.held("a") == 0 and table.held("b") == 5 and table.used == 5
    now[0] = 200.0
    snap = table.snapshot()  # a listing sweeps too
    assert snap == {"sessions": [], "kv_tokens": 0, "kv_tokens_max": 50, "idle_timeout_s": 10.0}


def test_idle_sweeper_thread_frees_a_replica_session(models):
    (rt,) = _runtimes(models["llama", 1], kv_idle_s=0.2)
    assert _post(rt, PROMPT, 0).status == 200 and rt.generation.table.used == len(PROMPT)
    done = threading.Event()
    for _ in range(100):
        if rt.generation.table.used == 0:
            done.set()
            break
        done.wait(0.05)
    assert done.is_set() and _post(rt, [1], len(PROMPT)).status == 409


def test_seeded_sampling_is_reproducible_across_replicas(models, references):
    sample = {"temperature": 1.5, "top_p": 0.95, "seed": 7}
    first = generate(_runtimes(models["opt", 3]), PROMPT, NEW, sample=sample).tokens
    replay = generate(_runtimes(models["opt", 2]), PROMPT, NEW, sample=sample, chunk=5).tokens
    other = generate(_runtimes(models["opt", 3]), PROMPT, NEW, sample={**sample, "seed": 8}).tokens
    assert first == replay and first != other and first != references["opt"][0]


def test_sampling_is_a_pure_function_of_seed_position_and_logits():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    p = sampling.parse_sample('{"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 3}')
    draws = [sampling.choose(logits, p, pos) for pos in range(200)]
    assert draws == [sampling.choose(logits, p, pos) for pos in range(200)]
    top50 = set(torch.topk(logits, 50).indices.tolist())
    assert set(draws) <= top50 and len(set(draws)) > 10
    assert sampling.choose(logits, sampling.GREEDY, 0) == int(logits.argmax())
    nucleus = sampling.parse_sample('{"temperature": 1.0, "top_p": 1e-9}')  # only the most likely token is left
    assert {sampling.choose(logits, nucleus, pos) for pos in range(50)} == {int(logits.argmax())}


@pytest.mark.parametrize("header, words", [
    ('{"temperature": -1}', "temperature"), ('{"top_p": 0}', "top_p"), ('{"top_p": 1.5}', "top_p"),
    ('{"seed": -1}', "seed"), ('{"seed": 1.5}', "seed"), ('{"top_k": -2}', "top_k"), ('{"tmp": 1}', "unknown"),
    ("[1]", "object"), ("{", "JSON"), ('{"temperature": true}', "temperature"),
])
def test_bad_sample_header_is_400(models, header, words):
    (rt,) = _runtimes(models["llama", 1])
    resp = _post(rt, PROMPT, 0, **{"X-Quart-Sample": header})
    assert resp.status == 400 and json.loads(resp.body)["field"] == "sample" and words in json.loads(resp.body)["error"]
    assert rt.generation.table.used == 0


def test_bad_session_requests_are_400_before_anything_is_held(models, tmp_path):
    runtimes = _runtimes(models["llama", 2])
    rt = runtimes[0]
    cases = [
        ({"X-Quart-Session": "bad id!", "X-Quart-Session-Pos": "0"}, {"input_ids": [PROMPT]}, "session"),
        ({"X-Quart-Session": "s"}, {"input_ids": [PROMPT]}, "session"),
        ({"X-Quart-Session": "s", "X-Quart-Session-Pos": "-1"}, {"input_ids": [PROMPT]}, "session"),
        ({"X-Quart-Session": "s", "X-Quart-Session-Pos": "0"}, {"input_ids": [PROMPT, PROMPT]}, "session"),
        ({"X-Quart-Session": "s", "X-Quart-Session-Pos": "0"},
         {"input_ids": [PROMPT], "attention_mask": [[1] * len(PROMPT)]}, "attention_mask"),
        ({"X-Quart-Session": "s", "X-Quart-Session-Pos": "60"}, {"input_ids": [PROMPT]}, "session"),  # > 64
        ({"X-Quart-Session": "s", "X-Quart-Session-Pos": "0", "X-Quart-Session-End": "yes"},
         {"input_ids": [PROMPT]}, "session"),
        ({"X-Quart-Session": "s", "X-Quart-Session-Pos": "0", "X-Quart-Layers": "0-"},  # a ParaServe part: valid
         {"input_ids": [PROMPT]}, "layers"),                                           # ranges only
    ]
    for headers, doc, field in cases:
        resp = rt.handle(json.dumps(doc).encode(), {"Content-Type": "application/json", **headers})
        assert resp.status == 400 and json.loads(resp.body)["field"] == field, (headers, resp.body)
    assert rt.generation.table.used == 0
    d = str(tmp_path / "enc")
    partition("tiny-encoder", 1, d, progress=False, seed=1)
    enc = StageRuntime.load(StageConfig(model_dir=d))
    resp = _post(enc, [1, 2], 0)
    assert resp.status == 400 and "not a decoder" in json.loads(resp.body)["error"]


def test_middle_stage_answers_hidden_states_of_the_new_positions_only(models):
    runtimes = _runtimes(models["mistral", 3])
    resp = _post(runtimes[0], PROMPT, 0)
    out = wire.decode(resp.body)
    assert out.tensors["hidden_states"].shape == (1, len(PROMPT), 32) and out.metadata["stage"] == "1"
    assert resp.headers["X-Quart-Session-Pos"] == str(len(PROMPT))
    assert resp.headers["X-Quart-KV-Tokens"].startswith(f"{len(PROMPT)}/")
    step = _post(runtimes[0], [5], len(PROMPT))
    assert wire.decode(step.body).tensors["hidden_states"].shape == (1, 1, 32)


def test_sessions_routes_list_and_free(models):
    (rt,) = _runtimes(models["llama", 1], kv_max_tokens=100)
    client = create_app(rt).test_client()
    assert _post(rt, PROMPT, 0, session="x", **{"X-Quart-Session-Reserve": "30"}).status == 200
    listing = client.get("/_/sessions").get_json()
    assert listing["kv_tokens"] == 30 and listing["kv_tokens_max"] == 100 and listing["idle_timeout_s"] == 120.0
    assert [(s["id"], s["tokens"], s["reserved"]) for s in listing["sessions"]] == [("x", len(PROMPT), 30)]
    assert client.delete("/_/sessions/x").status_code == 204
    assert client.delete("/_/sessions/x").status_code == 404
    assert client.get("/_/sessions").get_json()["kv_tokens"] == 0


def test_a_failed_step_frees_the_session(models, monkeypatch):
    (rt,) = _runtimes(models["llama", 1])
    assert _post(rt, PROMPT, 0).status == 200
    monkeypatch.setattr(rt.module, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    failed = _post(rt, [1], len(PROMPT))
    assert failed.status == 500 and json.loads(failed.body)["field"] == "compute"
    assert failed.headers["X-Quart-Session-Pos"] == "0" and rt.generation.table.used == 0
    monkeypatch.undo()
    assert _post(rt, [1], len(PROMPT)).status == 409  # the gateway replays


def test_function_handler_serves_the_session_routes(models):
    from types import SimpleNamespace

    from quart_stage.handler import StageHandler

    (rt,) = _runtimes(models["llama", 1])
    handle = StageHandler(rt)
    assert _post(rt, PROMPT, 0, session="h").status == 200
    listing = handle(SimpleNamespace(method="GET", path="/_/sessions", body=b"", headers={}), None)
    assert listing["statusCode"] == 200 and listing["body"]["sessions"][0]["id"] == "h"
    gone = handle(SimpleNamespace(method="DELETE", path="/_/sessions/h", body=b"", headers={}), None)
    again = handle(SimpleNamespace(method="DELETE", path="/_/sessions/h", body=b"", headers={}), None)
    assert gone["statusCode"] == 204 and again["statusCode"] == 404 and again["body"]["field"] == "session"


def test_emulated_sessions_count_positions_and_give_deterministic_tokens():
    def pipeline():
        return [StageRuntime.load(StageConfig(compute="emulated", profile="llama-7b", num_stages=3, stage_index=i,
                                              emulated_decode_ms=0.5, emulated_prefill_ms_per_token=0.01,
                                              emulated_cv=0.0, seed=1))
                for i in range(3)]

    runtimes = pipeline()
    first = generate(runtimes, PROMPT, 20)
    assert generate(pipeline(), PROMPT, 20, chunk=4).tokens == first.tokens  # a replay on other replicas
    assert len(set(first.tokens)) > 10 and all(0 <= t < 32000 for t in first.tokens)
    assert generate(runtimes, [*PROMPT, 1], 5).tokens != first.tokens[:5]
    assert _post(runtimes[0], PROMPT, 0, session="e").status == 200
    assert _post(runtimes[0], [1], 3, session="e").status == 409
    assert runtimes[0].generation.table.used == len(PROMPT)
    asked = session_step(runtimes, PROMPT, 0, "lp", sample={"logprobs": 1})  # no logits to answer them from
    assert asked.status == 400 and "emulated" in json.loads(asked.body)["error"]
    assert runtimes[2].generation.table.used == 0


def test_emulated_step_time_comes_from_the_profile():
    t = step_time_for(decode_ms=None, prefill_ms_per_token=None, mean_ms=None, cv=0.0, profile="llama-7b",
                      stage_bytes=[1, 1, 2], index=2)
    assert t.decode_ms == pytest.approx(6.0) and t.prefill_ms_per_token == pytest.approx(243.0 / 1024 / 2)
    assert t.mean_ms(1) == pytest.approx(6.0) and t.mean_ms(512) == pytest.approx(243.0 / 4)
    assert step_time_for(decode_ms=None, prefill_ms_per_token=None, mean_ms=None, cv=0.0, profile="bert-21b",
                         stage_bytes=[1], index=0) is None
    opt = step_time_for(decode_ms=None, prefill_ms_per_token=None, mean_ms=None, cv=0.0, profile="opt-66b",
                        stage_bytes=[1] * 8, index=0)
    assert opt.decode_ms == pytest.approx(90.0 / 8)


# ---------------------------------------------------------------- SmolLM2 (real weights)

@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    manifest, tensors = whole_tensors(smollm2_dir)
    return smollm2_dir, manifest, tensors, reference_model(smollm2_dir)


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_smollm2_greedy_tokens_equal_generate(smollm2, stages):
    model_dir, manifest, tensors, model = smollm2
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(stages)).tolist()
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  use_cache=True)[0, len(prompt):].tolist()
    bounds = split_layers(manifest.layer_parameter_counts, stages, manifest.method)
    got = generate(cut_runtimes(model_dir, manifest, tensors, bounds), prompt, 12, chunk=16 if stages == 3 else None)
    assert got.tokens == expected


def test_session_step_reports_the_first_failure(models):
    runtimes = _runtimes(models["llama", 2])
    resp = session_step(runtimes, [1], 3, "nobody")
    assert resp.status == 409 and resp.headers["X-Quart-Stage"] == "0"


@pytest.mark.parametrize("n", [1, 2])
def test_penalties_bias_and_min_tokens_equal_transformers_generate(models, n):
    """Greedy with a repetition penalty, a logit bias and min_tokens (the history sent per step, as the gateway
    does): transformers' generate with repetition_penalty, sequence_bias and min_new_tokens gives the same tokens."""
    model = reference_model(models["llama", 1])
    eos = reference_model(models["llama", 1]).generate(torch.tensor([PROMPT]), max_new_tokens=3, do_sample=False,
                                                       pad_token_id=0)[0, len(PROMPT) + 1].item()  # the 2nd token
    with torch.inference_mode():
        gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, use_cache=True,
                             repetition_penalty=1.8, sequence_bias={(17,): 1.5}, min_new_tokens=NEW,
                             eos_token_id=eos, pad_token_id=0)
    want = gen[0, len(PROMPT):].tolist()
    sample = {"repetition_penalty": 1.8, "logit_bias": {"17": 1.5}, "min_pos": len(PROMPT) + NEW, "suppress": [eos]}
    got = generate(_runtimes(models["llama", n]), PROMPT, NEW, sample=sample).tokens
    assert got == want and eos not in got
    plain = generate(_runtimes(models["llama", n]), PROMPT, NEW).tokens
    assert plain != got
    batched = generate_batched(_runtimes(models["llama", n]), [PROMPT, PROMPT[:5]], [NEW, 4], samples=[sample, None])
    assert batched[0] == want


@pytest.mark.parametrize("chunk", [None, 4])
def test_prompt_logprobs_equal_the_whole_models_log_softmax(models, chunk):
    """echo with logprobs: the last stage runs the head on every prompt position and answers each prompt token's
    logprob (and the top k), equal to the whole model's full forward; a chunked prefill gives its share each step."""
    runtimes = _runtimes(models["llama", 2])
    sample = sample_history.with_history({"prompt_logprobs": 2}, PROMPT, [])
    with torch.inference_mode():
        raw = torch.log_softmax(reference_model(models["llama", 1])(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    got, pos = [], 0
    for part in ([PROMPT] if chunk is None else [PROMPT[i:i + chunk] for i in range(0, len(PROMPT), chunk)]):
        doc = json.loads(session_step(runtimes, part, pos, "p", sample=sample).body)
        assert doc.get("prompt_from", pos + 1) == pos + 1
        got += doc.get("prompt", [])
        pos += len(part)
    assert len(got) == len(PROMPT) - 1
    for t, entry in enumerate(got, start=1):
        assert entry["logprob"] == pytest.approx(float(raw[t - 1, PROMPT[t]]), abs=LOGIT_TOL)
        assert [i for i, _ in entry["top"]] == torch.topk(raw[t - 1], 2).indices.tolist()
    assert doc["token"] == int(raw[-1].argmax())
