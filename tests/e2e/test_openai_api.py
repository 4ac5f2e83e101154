"""The OpenAI-compatible API and generation on /function/<model>, through the ``openai`` client and raw HTTP:
answers, streams, usage, stop strings, errors in OpenAI's shape, and a seeded fuzz with no 5xx. The stages
are tests/support/fake_session_stage.py replicas (their tokens a known function of the sequence); the tokenizer is
the ``tiny`` preset's (one token per byte) with a ChatML template."""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import time

import openai
import pytest
import requests
from gateway_plugin.generation.tokens import load_model
from support.fake_session_stage import reference
from support.generation_app import tiny_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tiny_server(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny(server):
    return load_model("tiny", server.dirs["tiny"])


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def expected(tiny, ids: list[int], n: int) -> str:
    return tiny.decode(reference(ids, n))


def chat_ids(tiny, text: str) -> list[int]:
    rendered = tiny.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False)
    return tiny.tokenizer.encode(rendered, add_special_tokens=False)


def test_models_lists_the_decoder_pipelines(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]  # "enc" is an encoder: not listed


def test_completions_streamed_and_not(client, tiny):
    ids = tiny.tokenizer.encode("Hello there", add_special_tokens=False)
    answer = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0)
    assert answer.choices[0].text == expected(tiny, ids, 12) and answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (11, 12, 23)
    chunks = list(client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == answer.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_chat_streamed_and_not_uses_the_chat_template(client, tiny):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    ids = chat_ids(tiny, "What is 2+2?")
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected(tiny, ids, 10)
    assert answer.usage.prompt_tokens == len(ids) and answer.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stop_string_cuts_the_text_and_ends_the_stream(client, tiny):
    ids = tiny.tokenizer.encode("abc", add_special_tokens=False)
    full = expected(tiny, ids, 20)
    stop = full[6:8]
    want = full[:full.find(stop)]
    answer = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stop=[stop])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (want, "stop")
    streamed = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def _error(res: requests.Response, status: int, param: str | None = None) -> dict:
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_bad_requests_get_4xx_in_openai_error_shape(server, client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    url = f"{server.url}/v1/completions"
    _error(requests.post(url, json={"model": "tiny", "prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    _error(requests.post(url, json={"model": "tiny", "prompt": "x", "max_tokens": 100_000}), 400, "max_tokens")
    assert "not a decoder" in _error(requests.post(url, json={"model": "enc", "prompt": "x"}), 400, "model")["message"]
    _error(requests.post(url, data=b'{"model": "tiny", "prompt": ', headers={"Content-Type": "application/json"}),
           400, "body")
    _error(requests.post(url, json={"model": "tiny", "prompt": "x" * 70_000}), 413, "body")
    _error(requests.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": []}), 400, "messages")
    _error(requests.post(url, json={"model": "tiny", "prompt": "x", "n": 0}), 400, "n")
    _error(requests.get(url), 405)
    _error(requests.get(f"{server.url}/v1/embeddings"), 404, "path")


def test_generation_on_function_model_streamed_and_not(server, tiny):
    url = f"{server.url}/function/tiny"
    answer = requests.post(url, json={"input_ids": [5, 6, 7], "max_tokens": 6}).json()
    assert answer["tokens"] == reference([5, 6, 7], 6) and answer["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert answer["ttft_ms"] > 0 and answer["tpot_ms"] > 0
    with requests.post(url, json={"prompt": "hi", "max_tokens": 5, "stream": True}, stream=True) as res:
        assert res.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in res.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    docs = [json.loads(e) for e in events[:-1]]
    ids = tiny.tokenizer.encode("hi", add_special_tokens=False)
    assert [d["token"] for d in docs[:-1]] == reference(ids, 5) and docs[-1]["finish_reason"] == "length"
    bad = requests.post(url, json={"prompt": "hi", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["field"] == "max_tokens"
    assert requests.post(url, json={"input_ids": [[5, 6, 7]]}).status_code == 418  # a matrix: the one-shot path


def test_ttft_and_tpot_are_in_the_metrics_and_the_records(server, client):
    client.completions.create(model="tiny", prompt="measure me", max_tokens=4, temperature=0)
    text = requests.get(f"{server.url}/metrics").text
    assert 'quart_generation_ttft_seconds_count{model="tiny"}' in text
    assert 'quart_generation_tpot_seconds_count{model="tiny"}' in text
    record = json.loads(server.records.getvalue().splitlines()[-1])
    assert record["model"] == "tiny" and record["status"] == 200 and record["tokens"] == 4
    assert 0 < record["ttft_ms"] <= record["latency_ms"] and record["tpot_ms"] > 0


def _fuzz_body(rng: random.Random):
    values = [None, True, 0, -1, 1, 2, 3, 7, 10**9, 0.5, -0.5, 2.5, float("nan"), "", "x", "tiny", "nope",
              [], [1, 2], [[1, 2]], ["a"], {}, {"include_usage": True}, [{"role": "user", "content": "hi"}],
              [{"role": "bogus"}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [-5], [300]]
    keys = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
            "stream_options", "n", "input_ids", "stop_token_ids", "logprobs", "max_completion_tokens"]
    doc: dict = {}
    if rng.random() < 0.6:  # a valid request for every door, then a few fields changed
        doc = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": rng.choice([1, 2, 3])}
    for key in rng.sample(keys, rng.randint(0, 3 if doc else 6)):
        doc[key] = rng.choice(values)
    roll = rng.random()
    if roll < 0.05:
        return b"{not json"
    if roll < 0.08:
        return json.dumps([doc]).encode()
    return json.dumps(doc, allow_nan=True).encode()


def test_seeded_fuzz_of_the_generation_doors_gives_no_5xx(server):
    rng = random.Random(27)
    doors = [f"{server.url}/v1/completions", f"{server.url}/v1/chat/completions", f"{server.url}/function/tiny"]
    statuses: dict[int, int] = {}
    with requests.Session() as http:
        for _ in range(1200):
            res = http.post(rng.choice(doors), data=_fuzz_body(rng), headers={"Content-Type": "application/json"},
                            timeout=30)
            statuses[res.status_code] = statuses.get(res.status_code, 0) + 1
            assert res.status_code < 500, res.text
            if res.headers.get("Content-Type", "").startswith("text/event-stream"):
                assert res.text.endswith("data: [DONE]\n\n")
            elif res.status_code != 418:
                res.json()
    assert statuses.get(200, 0) > 50 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 300, statuses
    assert all(f.sessions == {} for f in server.fakes)  # every session's caches were freed


def test_a_client_that_goes_away_mid_stream_frees_the_session_caches(server):
    before, calls = [len(f.deleted) for f in server.fakes], server.fakes[1].calls
    server.fakes[1].delay_s = 0.01  # 200 tokens would take 2 s: the client is gone long before
    host, port = server.url.split("//")[1].split(":")
    body = json.dumps({"model": "tiny", "prompt": "go", "max_tokens": 200, "temperature": 0, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 10  # the socket is closed: the next event's write finds the client gone
    while any(f.sessions for f in server.fakes) or server.engine.active:
        assert time.monotonic() < deadline, [f.sessions for f in server.fakes]
        time.sleep(0.02)
    server.fakes[1].delay_s = 0.0
    assert all(len(f.deleted) == n + 1 for f, n in zip(server.fakes, before, strict=True))  # DELETE on each stage
    assert server.fakes[1].calls - calls < 150 and server.engine.book.reserved == {}


def test_a_session_with_no_kv_room_is_refused_429_with_retry_after(server, client):
    full = server.engine.book.cap("tiny#1")
    server.engine.book.reserve("tiny#1", full)  # other sessions hold the last stage's whole cache
    try:  # each request waits in line QUART_GEN_ROOM_WAIT_S (10 s) first: the client waits longer
        res = requests.post(f"{server.url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=30)
        err = _error(res, 429)
        assert err["type"] == "rate_limit_error" and "room" in err["message"] and res.headers["Retry-After"] == "1"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        native = requests.post(f"{server.url}/function/tiny", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert native.status_code == 429 and native.headers["Retry-After"] == "1"
    finally:
        server.engine.book.release("tiny#1", full)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_a_stream_that_cannot_go_on_ends_with_an_error_event_and_done(server):
    server.fakes[1].fail_next = 100  # the last stage answers 500 every time, and it has no other replica
    try:
        res = requests.post(f"{server.url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
            timeout=30)
        events = [line[6:] for line in res.text.splitlines() if line.startswith("data: ")]
        assert res.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "503" and "HTTP 500" in error["message"] and error["param"] == "stage"
        plain = requests.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                              timeout=30)
        assert plain.status_code == 503 and plain.json()["error"]["param"] == "stage"
    finally:
        server.fakes[1].fail_next = 0
    assert server.engine.active == {} and server.engine.book.reserved == {}


# ---------------------------------------------------------------- timing and defaults as the field reports them

def _first_event_s(url: str, body: dict) -> tuple[float, dict]:
    """Seconds from sending ``body`` to the stream's first ``data:`` event, and that event."""
    start = time.monotonic()
    with requests.post(url, json=body, stream=True, timeout=30) as res:
        for line in res.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                first = time.monotonic() - start
                event = json.loads(line[6:])
                for _ in res.iter_lines():  # read the stream to its end
                    pass
                return first, event
    raise AssertionError("no event")


def _whole_first_token(tiny, texts: list[str]) -> str:
    """A text whose first generated token (chat-rendered and plain) is a whole character: the first event
    carries it (no UTF-8 byte held back)."""
    def whole(ids: list[int]) -> bool:
        first = tiny.decode(reference(ids, 1))
        return bool(first) and "\ufffd" not in first

    for text in texts:
        if whole(chat_ids(tiny, text)) and whole(tiny.tokenizer.encode(text, add_special_tokens=False)):
            return text
    raise AssertionError("no such text")


def test_the_first_chat_chunk_carries_the_first_token_so_ttft_is_the_prefill(server, client, tiny):
    """vLLM sends the chat stream's role with the first token; ``vllm bench serve --backend openai-chat`` takes
    its TTFT at the first chunk, ``--backend openai`` at the first text: both must see the prefill (issue 41)."""
    text = _whole_first_token(tiny, [f"{w} {k}" for w in ("tell me", "say", "hi there", "go", "ask") for k in range(60)])
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                                 max_tokens=4, temperature=0, stream=True))
    first = tiny.decode(reference(chat_ids(tiny, text), 1))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == first
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    delay = 0.25
    server.fakes[1].delay_s = delay  # the last stage's every call (the prefill's too) takes this long
    try:
        chat, completion = [], []
        for _ in range(3):
            s, event = _first_event_s(f"{server.url}/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3, "stream": True,
                "temperature": 0})
            assert event["choices"][0]["delta"] == {"role": "assistant", "content": first}
            chat.append(s)
            s, event = _first_event_s(f"{server.url}/v1/completions", {
                "model": "tiny", "prompt": text, "max_tokens": 3, "stream": True, "temperature": 0})
            assert event["choices"][0]["text"]
            completion.append(s)
    finally:
        server.fakes[1].delay_s = 0.0
    chat_s, completion_s = sorted(chat)[1], sorted(completion)[1]
    assert chat_s >= delay and completion_s >= delay, (chat, completion)  # the role no longer comes before prefill
    assert abs(chat_s - completion_s) <= 0.1 * max(chat_s, completion_s), (chat, completion)


def test_chat_without_max_tokens_runs_to_the_context_unless_bounded(server, client, tiny):
    messages = [{"role": "user", "content": "go on"}]
    prompt = len(chat_ids(tiny, "go on"))
    bounded = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
    assert bounded.usage.completion_tokens == 8  # the fixture's QUART_GEN_DEFAULT_MAX_TOKENS=8
    kept = server.api.config
    server.api.config = dataclasses.replace(kept, default_max_tokens=0)  # the default: the rest of the context
    try:
        answer = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
        native = requests.post(f"{server.url}/function/tiny", json={"input_ids": [5, 6, 7], "stream": False},
                               timeout=30).json()
        completion = client.completions.create(model="tiny", prompt="go on", temperature=0)
    finally:
        server.api.config = kept
    assert answer.usage.completion_tokens == tiny.context - prompt and answer.choices[0].finish_reason == "length"
    assert answer.usage.total_tokens == tiny.context
    assert native["usage"]["completion_tokens"] == tiny.context - 3
    assert completion.usage.completion_tokens == 16  # /v1/completions keeps OpenAI's default


def test_a_context_overflow_is_worded_as_openai_words_it(server, client, tiny):
    """LiteLLM maps an OpenAI-compatible 400 to ContextWindowExceededError when its message holds "This model's
    maximum context length is" (litellm_core_utils/exception_mapping_utils.py); OpenAI's code says the same."""
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 400}], max_tokens=2)
    err = long_prompt.value.body
    assert err["message"].startswith("This model's maximum context length is 256 tokens. However, your request has")
    assert (err["code"], err["param"], err["type"]) == ("context_length_exceeded", "messages", "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model="tiny", prompt="hello", max_tokens=300)
    err = too_many.value.body
    assert err["message"] == ("This model's maximum context length is 256 tokens. However, you requested 305 tokens "
                              "(5 in the prompt, 300 in the completion). Please reduce the length of the prompt or "
                              "completion.")
    assert (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens")


def test_models_carry_max_model_len_and_root(client, tiny):
    [card] = client.models.list().data
    assert (card.id, card.max_model_len, card.root, card.owned_by) == ("tiny", tiny.context, "tiny", "quart")


def _sample(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_metrics_under_vllm_names_beside_ours(server, client):
    names = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:inter_token_latency_seconds_count",
             "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count")
    before = requests.get(f"{server.url}/metrics", timeout=10).text
    answer = client.completions.create(model="tiny", prompt="count me", max_tokens=5, temperature=0)
    after = requests.get(f"{server.url}/metrics", timeout=10).text
    grew = {n: _sample(after, n, model_name="tiny") - _sample(before, n, model_name="tiny") for n in names}
    assert grew == {"vllm:generation_tokens_total": 5, "vllm:prompt_tokens_total": answer.usage.prompt_tokens,
                    "vllm:inter_token_latency_seconds_count": 4, "vllm:time_to_first_token_seconds_count": 1,
                    "vllm:e2e_request_latency_seconds_count": 1}
    assert 'quart_generation_ttft_seconds_count{model="tiny"}' in after  # ours are kept
    assert _sample(after, "vllm:num_requests_running", model_name="tiny") == 0
    assert _sample(after, "vllm:num_requests_waiting", model_name="tiny") == 0
    server.fakes[1].delay_s = 0.2
    try:  # one request in flight: running while it generates
        stream = requests.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3,
                                                                      "stream": True}, stream=True, timeout=30)
        deadline = time.monotonic() + 5
        while _sample(requests.get(f"{server.url}/metrics", timeout=10).text, "vllm:num_requests_running",
                      model_name="tiny") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stream.close()
    finally:
        server.fakes[1].delay_s = 0.0
