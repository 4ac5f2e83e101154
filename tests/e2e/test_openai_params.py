"""OpenAI's and vLLM's sampling parameters through the ``openai`` client, streamed and not, chat and completions:
each changes the answer as the sampler says (tests/unit/test_sampling.py checks the sampler against transformers'
logits processors). The stages are tests/support/fake_session_stage.py replicas: their last stage runs the real
sampler on toy logits whose maximum is the toy model's token, so greedy answers stay the reference."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from gateway_plugin.generation.tokens import load_model
from quart_stage import sampling
from support.fake_session_stage import reference, toy_logits
from support.generation_app import tiny_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tiny_server(tmp_path_factory)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def tiny(server):
    """The tokenizer the answers are checked with."""
    return load_model("tiny", server.dirs["tiny"])


def simulate(prompt: list[int], n: int, **sample) -> list[int]:
    """What the sampler gives on the toy logits, the history kept here (prompt + generated) as vLLM defines it."""
    out: list[int] = []
    for _ in range(n):
        seq = prompt + out
        logits = toy_logits(seq).clone()
        for token in set(seq):  # repetition penalty: every id seen, prompt or generated
            rp = sample.get("repetition_penalty", 1.0)
            logits[token] = logits[token] / rp if logits[token] > 0 else logits[token] * rp
        for token in set(out):
            logits[token] -= sample.get("presence_penalty", 0.0) + sample.get("frequency_penalty", 0.0) * out.count(token)
        out.append(int(torch.argmax(logits)))
    return out


def ids_of(tiny, text: str) -> list[int]:
    return tiny.tokenizer.encode(text, add_special_tokens=False)


def chat_ids(tiny, text: str) -> list[int]:
    rendered = tiny.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False)
    return tiny.tokenizer.encode(rendered, add_special_tokens=False)


def complete(client, stream: bool, **kw) -> str:
    if not stream:
        return client.completions.create(model="tiny", **kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(model="tiny", stream=True, **kw) if c.choices)


def chat(client, stream: bool, **kw) -> str:
    if not stream:
        return client.chat.completions.create(model="tiny", **kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(model="tiny", stream=True, **kw)
                   if c.choices)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5},
                                     {"repetition_penalty": 2.0}])
def test_penalties_change_greedy_text_as_the_sampler_says(client, tiny, stream, penalty):
    ids = ids_of(tiny, "Hello there")
    plain = complete(client, stream, prompt="Hello there", max_tokens=24, temperature=0)
    assert plain == tiny.decode(reference(ids, 24))
    vllm_only = {k: v for k, v in penalty.items() if k == "repetition_penalty"}
    openai_own = {k: v for k, v in penalty.items() if k != "repetition_penalty"}
    text = complete(client, stream, prompt="Hello there", max_tokens=24, temperature=0, extra_body=vllm_only,
                    **openai_own)
    assert text == tiny.decode(simulate(ids, 24, **penalty)) and text != plain
    said = chat(client, stream, messages=[{"role": "user", "content": "Hi"}], max_tokens=24, temperature=0,
                extra_body=vllm_only, **openai_own)
    assert said == tiny.decode(simulate(chat_ids(tiny, "Hi"), 24, **penalty))


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_top_k_and_min_p(client, tiny, stream):
    [a], [b] = ids_of(tiny, "A"), ids_of(tiny, "B")
    forced = complete(client, stream, prompt="abc", max_tokens=6, temperature=0, logit_bias={str(a): 100})
    assert forced == "AAAAAA"
    said = chat(client, stream, messages=[{"role": "user", "content": "x"}], max_tokens=5, logit_bias={str(b): 100})
    assert said == "BBBBB"
    greedy = complete(client, stream, prompt="abc", max_tokens=10, temperature=0)
    assert complete(client, stream, prompt="abc", max_tokens=10, temperature=1.8, seed=3, extra_body={"top_k": 1}) == greedy
    assert complete(client, stream, prompt="abc", max_tokens=10, temperature=1.8, seed=3, extra_body={"min_p": 0.9}) == greedy
    free = [complete(client, stream, prompt="abc", max_tokens=10, temperature=1.8, seed=s) for s in range(3)]
    assert any(f != greedy for f in free)


def test_seeded_sampling_with_penalties_reproduces(client):
    kw = {"prompt": "seeded", "max_tokens": 16, "temperature": 1.0, "seed": 42, "presence_penalty": 1.0,
          "extra_body": {"top_k": 30, "min_p": 0.01, "repetition_penalty": 1.2}}
    assert complete(client, False, **kw) == complete(client, True, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_the_stop_ids_and_stop_strings_back(client, tiny, stream):
    ids = ids_of(tiny, "abc")
    ref = reference(ids, 12)
    stop_id = ref[2]
    short = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [stop_id]})
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens == 3
    text = complete(client, stream, prompt="abc", max_tokens=12, temperature=0,
                    extra_body={"stop_token_ids": [stop_id], "min_tokens": 12})
    assert len(text) == 12 and tiny.decode([stop_id]) not in text  # the id could not be drawn before the 12th
    full = tiny.decode(ref)
    stop = full[1:3]
    assert complete(client, stream, prompt="abc", max_tokens=12, temperature=0, stop=[stop]) == full[:1]
    kw = {"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop": [stop], "extra_body": {"min_tokens": 4}}
    answer = client.completions.create(model="tiny", **kw)
    assert answer.usage.completion_tokens >= 4 and full.startswith(answer.choices[0].text)
    assert len(answer.choices[0].text) > 1 and complete(client, stream, **kw) == answer.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(client, tiny, stream):
    full = tiny.decode(reference(ids_of(tiny, "abc"), 20))
    stop = full[6:8]
    cut = full.find(stop)
    text = complete(client, stream, prompt="abc", max_tokens=20, temperature=0, stop=[stop],
                    extra_body={"include_stop_str_in_output": True})
    assert text == full[: cut + len(stop)]


def test_the_stage_gets_the_history_the_penalties_read(server, client, tiny):
    last = server.fakes[-1]
    last.samples.clear()
    client.completions.create(model="tiny", prompt="hist", max_tokens=4, temperature=0, presence_penalty=1.0,
                              extra_body={"repetition_penalty": 1.5})
    prompt = ids_of(tiny, "hist")
    histories = [s.history.tolist() for s in last.samples]
    assert histories[0] == prompt and all(s.prompt_len == len(prompt) for s in last.samples)
    assert [len(h) for h in histories] == [len(prompt) + k for k in range(4)]


@pytest.mark.parametrize("body, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_bad_values_are_400_naming_the_field(client, body, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", **{"max_tokens": 4, **{}}, extra_body=body)
    assert err.value.body["param"] == field, json.dumps(err.value.body)


def test_sampler_module_is_what_the_fake_stage_runs():
    logits = toy_logits([1, 2, 3])
    assert sampling.choose(logits, sampling.GREEDY, 3) == reference([1, 2, 3], 1)[0]


def _raw(seq: list[int]) -> torch.Tensor:
    return torch.log_softmax(toy_logits(seq), dim=-1)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs(client, tiny, stream):
    ids = chat_ids(tiny, "lp")
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "lp"}], "max_tokens": 6, "temperature": 0,
          "logprobs": True, "top_logprobs": 3}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    tokens = reference(ids, 6)
    assert [e.token for e in content] == [tiny.decode([t]) for t in tokens]
    for k, (entry, token) in enumerate(zip(content, tokens, strict=True)):
        raw = _raw(ids + tokens[:k])
        assert entry.logprob == pytest.approx(float(raw[token]), abs=1e-5)
        assert [t.token for t in entry.top_logprobs] == [tiny.decode([i]) for i in torch.topk(raw, 3).indices.tolist()]
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_and_echo(client, tiny, stream):
    ids = ids_of(tiny, "echo me")
    tokens = reference(ids, 5)
    kw = {"model": "tiny", "prompt": "echo me", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
        lps = [c.logprobs for c in chunks if c.logprobs]
        got = [t for lp in lps for t in lp.token_logprobs]
        offsets = [o for lp in lps for o in lp.text_offset]
        tops = [t for lp in lps for t in lp.top_logprobs]
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        got, offsets, tops = lp.token_logprobs, lp.text_offset, lp.top_logprobs
    want = [float(_raw(ids + tokens[:k])[t]) for k, t in enumerate(tokens)]
    assert got == pytest.approx(want, abs=1e-5) and all(len(t) <= 2 for t in tops)
    assert offsets == [len(tiny.decode(tokens[:k])) for k in range(5)]
    echoed = complete(client, stream, prompt="echo me", max_tokens=5, temperature=0, echo=True)
    assert echoed == "echo me" + tiny.decode(tokens)


@pytest.mark.parametrize("door, body, field", [
    ("chat", {"top_logprobs": 2}, "top_logprobs"), ("chat", {"logprobs": 3}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"echo": True, "logprobs": 1, "stream": True}, "echo"), ("completions", {"top_logprobs": 1}, "top_logprobs"),
])
def test_bad_logprobs_are_400_naming_the_field(client, door, body, field):
    with pytest.raises(openai.BadRequestError) as err:
        if door == "chat":
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           extra_body=body)
        else:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=body)
    assert err.value.body["param"] == field


def test_n_choices_are_the_seeded_single_answers(client):
    kw = {"model": "tiny", "prompt": "many", "max_tokens": 8, "temperature": 1.2}
    several = client.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in several.choices] == [0, 1, 2]
    singles = [client.completions.create(seed=40 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in several.choices] == singles and len(set(singles)) > 1
    assert several.usage.completion_tokens == 24 and several.usage.prompt_tokens == 4
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=6,
                                          temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_n_streamed_chunks_carry_each_choices_index(client):
    kw = {"model": "tiny", "prompt": "many", "max_tokens": 8, "temperature": 1.2, "seed": 40, "n": 3}
    texts, finished = ["", "", ""], set()
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == [c.text for c in client.completions.create(**kw).choices] and finished == {0, 1, 2}
    assert chunk.usage.completion_tokens == 24
    seen = set()
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2,
                                                max_tokens=4, stream=True, seed=1):
        seen |= {c.index for c in chunk.choices}
    assert seen == {0, 1}


def test_best_of_answers_the_n_with_the_highest_logprob_sum(client):
    kw = {"model": "tiny", "prompt": "best", "max_tokens": 6, "temperature": 1.5}
    sums = []
    for i in range(4):
        lp = client.completions.create(seed=7 + i, logprobs=0, **kw).choices[0]
        sums.append((sum(lp.logprobs.token_logprobs), lp.text))
    best = client.completions.create(seed=7, best_of=4, n=2, **kw)
    assert [c.text for c in best.choices] == [t for _, t in sorted(sums, key=lambda x: -x[0])[:2]]
    assert best.choices[0].logprobs is None and [c.index for c in best.choices] == [0, 1]
    assert client.completions.create(seed=7, best_of=1, **kw).choices[0].text == sums[0][1]


def test_a_list_of_prompts_gets_choices_in_openais_order(client, tiny):
    answer = client.completions.create(model="tiny", prompt=["one", "two", [5, 6, 7]], max_tokens=5, temperature=0,
                                       n=2)
    assert [c.index for c in answer.choices] == list(range(6))
    want = [tiny.decode(reference(ids_of(tiny, "one"), 5)), tiny.decode(reference(ids_of(tiny, "two"), 5)),
            tiny.decode(reference([5, 6, 7], 5))]
    assert [c.text for c in answer.choices] == [w for w in want for _ in range(2)]
    assert answer.usage.prompt_tokens == 3 + 3 + 3


@pytest.mark.parametrize("body, field", [
    ({"n": 0}, "n"), ({"n": 65}, "n"), ({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
    ({"prompt": ["a"] * 65}, "prompt"), ({"prompt": ["a", ""]}, "prompt[1]"),
])
def test_bad_choices_are_refused_naming_the_field(server, body, field):
    import requests

    res = requests.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, **body})
    assert res.status_code in (400, 413) and res.json()["error"]["param"] == field, res.text


def test_langchain_tool_fields_are_accepted(client, tiny):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                            tool_choice="none")
    rendered = tiny.tokenizer.apply_chat_template([{**m, "content": m["content"] or ""} for m in messages],
                                                  add_generation_prompt=True, tokenize=False)
    ids = tiny.tokenizer.encode(rendered, add_special_tokens=False)
    assert answer.choices[0].message.content == tiny.decode(reference(ids, 4))
    for body, field in (({"tool_choice": "auto"}, "tool_choice"),
                        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
                         "messages[0].tool_calls"),
                        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=body)
        assert err.value.body["param"] == field


def test_echo_with_logprobs_gives_the_prompts_logprobs_too(client, tiny):
    ids = ids_of(tiny, "score this")
    answer = client.completions.create(model="tiny", prompt="score this", max_tokens=3, temperature=0, echo=True,
                                       logprobs=1)
    lp = answer.choices[0].logprobs
    tokens = reference(ids, 3)
    seq = ids + tokens
    assert answer.choices[0].text == "score this" + tiny.decode(tokens)
    assert lp.tokens == [tiny.decode([t]) for t in seq] and lp.token_logprobs[0] is None
    want = [float(_raw(seq[:t])[seq[t]]) for t in range(1, len(seq))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5) and lp.text_offset[0] == 0
    scored = client.completions.create(model="tiny", prompt="score this", max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == "score this" and scored.usage.completion_tokens == 0  # lm-eval's loglikelihood
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx([None, *want[:len(ids) - 1]], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
