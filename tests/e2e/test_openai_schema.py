"""Every field of OpenAI's request schemas — CreateChatCompletionRequest and CreateCompletionRequest, as the installed
``openai`` client types them (``openai.types.chat.completion_create_params``, ``openai.types.completion_create_params``)
— and vLLM's sampling extensions is honoured (a request with it answers differently, or, for identifiers and the
one-tier hints, exactly as without it, which is what the field means) or refused with a 400 naming it; a field the
client gains later fails this test until it is classified. Unknown fields are refused by name too."""

from __future__ import annotations

import typing

import pytest
import requests
from openai.types import completion_create_params as completion_types
from openai.types.chat import completion_create_params as chat_types
from support.generation_app import tiny_server


def _fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


CHAT_FIELDS, COMPLETION_FIELDS = _fields(chat_types), _fields(completion_types)
VLLM_FIELDS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
               "include_stop_str_in_output"}

REFUSED = {  # field -> a value a client could send, refused by name
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}], "metadata": {"k": "v"}, "moderation": {"model": "x"},
    "parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"},
    "prompt_cache_options": {"x": 1}, "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
    "verbosity": "low", "web_search_options": {}, "suffix": "tail",
}
PARTLY = {  # field -> (a value honoured, a value refused)
    "store": (False, True), "service_tier": ("auto", "priority"), "modalities": (["text"], ["text", "audio"]),
    "tool_choice": ("none", "auto"), "stream_options": ({"include_usage": True}, {"include_obfuscation": True}),
    "logprobs": (None, None), "n": (2, 0), "best_of": (2, 0),
}
NO_EFFECT = {  # identifiers and hints: the answer is the one without them (what they mean)
    "user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "k-1", "store": False, "service_tier": "auto",
    "modalities": ["text"], "tool_choice": "none",
}
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tiny_server(tmp_path_factory)


def _post(server, door: str, **body) -> requests.Response:
    base = {"model": "tiny", **({"messages": [{"role": "user", "content": "schema"}]} if door == "chat"
                                else {"prompt": "schema"})}
    path = "chat/completions" if door == "chat" else "completions"
    return requests.post(f"{server.url}/v1/{path}", json={**base, **body}, timeout=30)


def _text(res: requests.Response) -> list[str]:
    assert res.status_code == 200, res.text
    if res.headers["Content-Type"].startswith("text/event-stream"):
        return [res.text]
    return [c["message"]["content"] if "message" in c else c["text"] for c in res.json()["choices"]]


def _changes(server, door: str, field: str) -> bool:
    """Whether a request with ``field`` answers differently from the same request without it (greedy baseline)."""
    base = _text(_post(server, door, **GREEDY))
    body = {
        "model": None, "messages": None, "prompt": None,  # checked below
        "max_tokens": {"max_tokens": 3}, "max_completion_tokens": {"max_completion_tokens": 3, "max_tokens": None},
        "temperature": {"temperature": 1.8, "seed": 1}, "seed": {"temperature": 1.8, "seed": 2},
        "top_p": {"temperature": 1.8, "seed": 1, "top_p": 0.05}, "top_k": {"temperature": 1.8, "seed": 1, "top_k": 2},
        "min_p": {"temperature": 1.8, "seed": 1, "min_p": 0.3},
        "stop": {"stop": [base[0][3:5]]}, "n": {"n": 2}, "best_of": {"best_of": 2, "temperature": 1.8, "seed": 1},
        "presence_penalty": {"presence_penalty": 2.0, "max_tokens": 24},
        "frequency_penalty": {"frequency_penalty": 2.0, "max_tokens": 24},
        "repetition_penalty": {"repetition_penalty": 2.0, "max_tokens": 24},
        "logit_bias": {"logit_bias": {"70": 100}}, "min_tokens": {"min_tokens": 12, "stop": [base[0][3:5]]},
        "stop_token_ids": {"stop_token_ids": [70]}, "ignore_eos": None, "include_stop_str_in_output": {
            "include_stop_str_in_output": True, "stop": [base[0][3:5]]},
        "echo": {"echo": True}, "stream": {"stream": True},
    }[field]
    if field in ("model", "messages", "prompt"):
        other = _post(server, door, **GREEDY, **{"model": "nope"} if field == "model" else
                      {"messages": [{"role": "user", "content": "other"}]} if field == "messages" else {"prompt": "other"})
        return other.status_code != 200 or _text(other) != base
    if field == "ignore_eos":  # EOS (id 2) forced: one token, or max_tokens with ignore_eos
        counts = [_post(server, door, **GREEDY, logit_bias={"2": 100}, **extra).json()["usage"]["completion_tokens"]
                  for extra in ({}, {"ignore_eos": True})]
        return counts == [1, GREEDY["max_tokens"]]
    if field in ("min_tokens", "include_stop_str_in_output"):  # against the same stop without the field
        base = _text(_post(server, door, **GREEDY, stop=body["stop"]))
    if field == "stop_token_ids":
        base = _text(_post(server, door, **GREEDY, logit_bias={"70": 100}))
        body = {**body, "logit_bias": {"70": 100}}
    return _text(_post(server, door, **{**GREEDY, **body})) != base


def _logprobs_shown(server, door: str) -> bool:
    body = {"logprobs": True, "top_logprobs": 2} if door == "chat" else {"logprobs": 2}
    choice = _post(server, door, **GREEDY, **body).json()["choices"][0]
    return choice["logprobs"] is not None and _post(server, door, **GREEDY).json()["choices"][0]["logprobs"] is None


def _usage_streamed(server, door: str) -> bool:
    res = _post(server, door, **GREEDY, stream=True, stream_options={"include_usage": True})
    return '"usage"' in res.text and '"usage"' not in _post(server, door, **GREEDY, stream=True).text


@pytest.mark.parametrize("door, fields", [("chat", CHAT_FIELDS | VLLM_FIELDS),
                                          ("completion", COMPLETION_FIELDS | VLLM_FIELDS)])
def test_every_request_field_is_honoured_or_refused_by_name(server, door, fields):
    honoured, refused = [], []
    for field in sorted(fields):
        if field in REFUSED:
            res = _post(server, door, **GREEDY, **{field: REFUSED[field]})
            assert res.status_code == 400 and res.json()["error"]["param"] == field, (field, res.text)
            refused.append(field)
            continue
        if field in PARTLY and PARTLY[field][1] is not None:
            res = _post(server, door, **GREEDY, **{field: PARTLY[field][1]})
            assert res.status_code == 400 and res.json()["error"]["param"].startswith(field), (field, res.text)
        if field in NO_EFFECT:
            assert _text(_post(server, door, **GREEDY, **{field: NO_EFFECT[field]})) == \
                _text(_post(server, door, **GREEDY)), field
        elif field in ("logprobs", "top_logprobs"):
            assert _logprobs_shown(server, door), field
        elif field == "stream_options":
            assert _usage_streamed(server, door)
        else:
            assert _changes(server, door, field), f"{field} has no effect on {door}"
        honoured.append(field)
    assert set(honoured) | set(refused) == fields


@pytest.mark.parametrize("door", ["chat", "completion"])
def test_unknown_and_other_doors_fields_are_refused_by_name(server, door):
    for field, value in (("use_beam_search", True), ("guided_json", {}), ("frobnicate", 1),
                         ("echo" if door == "chat" else "top_logprobs", 1),
                         ("best_of" if door == "chat" else "max_completion_tokens", 2)):
        res = _post(server, door, **GREEDY, **{field: value})
        assert res.status_code == 400 and res.json()["error"]["param"] == field, (field, res.text)
