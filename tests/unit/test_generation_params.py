"""Pure parts of generation on the gateway: which /function bodies generate, parameter checks (a 400 naming
the field), and the incremental text with stop strings and held-back partial characters."""

from __future__ import annotations

import pytest
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.params import is_generation, parse
from gateway_plugin.generation.tokens import ModelInfo, TextStream
from quart_stage.errors import QuartError

CFG = GenerationConfig(max_prompt_chars=100, max_messages=4)


@pytest.mark.parametrize(("doc", "generates"), [
    ({"prompt": "hi"}, True), ({"input_ids": [1, 2, 3]}, True), ({"input_ids": [[1, 2, 3]], "max_tokens": 4}, True),
    ({"input_ids": [[1, 2, 3]]}, False), ({"text": ["a", "b"]}, False), ({"input_ids": []}, False),
    ({"stream": False}, True), ([1, 2], False), ("prompt", False),
])
def test_which_function_bodies_are_generation_requests(doc, generates):
    assert is_generation(doc) is generates


@pytest.mark.parametrize(("doc", "door", "field"), [
    ({"prompt": "x"}, "completion", "model"),
    ({"model": "m", "prompt": ""}, "completion", "prompt"),
    ({"model": "m", "prompt": ["a", "b"] * 40}, "completion", "prompt"),
    ({"model": "m", "prompt": ["a", 5]}, "completion", "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "completion", "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "completion", "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "completion", "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "completion", "top_p"),
    ({"model": "m", "prompt": "x", "seed": 2**64}, "completion", "seed"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "completion", "stop"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "completion", "stream"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "completion", "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": 2}, "native", "logprobs"),
    ({"model": "m", "prompt": "x", "n": 2}, "native", "n"),
    ({"model": "m", "prompt": "x" * 101}, "completion", "prompt"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}] * 5}, "chat", "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "chat", "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "chat", "messages[0].content"),
    ({"prompt": "x", "input_ids": [1]}, "native", "prompt"),
])
def test_bad_parameters_are_refused_naming_the_field(doc, door, field):
    with pytest.raises(QuartError) as refused:
        parse(doc, door, CFG, "m" if door == "native" else None)
    assert refused.value.status in (400, 413) and refused.value.field == field


def test_logprobs_and_choices_as_each_door_spells_them():
    assert parse({"model": "m", "prompt": "x", "logprobs": False}, "completion", CFG).logprobs is None
    assert parse({"model": "m", "prompt": "x", "logprobs": 0}, "completion", CFG).logprobs == 0
    chat = parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4,
                  "n": 3}, "chat", CFG)
    assert (chat.logprobs, chat.n, chat.runs) == (4, 3, 3)
    many = parse({"model": "m", "prompt": ["a", [5, 6]], "best_of": 3, "n": 2, "echo": True, "max_tokens": 0},
                 "completion", CFG)
    assert [(p.prompt, p.prompt_ids) for p in many.prompts()] == [("a", None), (None, (5, 6))] and many.runs == 3
    assert many.sample(4, frozenset({2}))["seed"] is None and "logprobs" not in many.sample(4, frozenset({2}))


def test_defaults_per_door():
    native = parse({"input_ids": [1, 2]}, "native", CFG, "m")
    assert (native.temperature, native.prompt_ids, native.max_tokens) == (0.0, (1, 2), None)
    chat = parse({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}],
                  "stop": "x", "stop_token_ids": [7]}, "chat", CFG)
    assert chat.temperature == 1.0 and chat.messages == (("system", "a"),) and chat.stop == ("x",)
    assert chat.stop_ids == (7,)


class _Chars:
    """A tokenizer stand-in: token i is the i-th character of ``alphabet`` (the last one, U+FFFD, stands in
    for the first byte of a character that the next token completes)."""

    def __init__(self, alphabet: str) -> None:
        self.alphabet = alphabet

    def decode(self, ids, skip_special_tokens=True) -> str:
        text = "".join(self.alphabet[i] for i in ids)
        return text.replace("\ufffdé", "é")


def test_text_is_held_back_while_it_could_become_a_stop_string():
    model = ModelInfo("m", "", 100, frozenset(), _Chars("abcdEND"))
    text = TextStream(model, ("END",))
    out = [text.push(t) for t in (0, 1, 4, 5, 2)]  # a b E N c: the last two characters are always held
    assert out == ["", "", "a", "b", "E"] and not text.stopped
    assert text.push(3) == "N"
    out = [text.push(t) for t in (4, 5, 6)]  # E N D: the stop string; nothing of it is handed out
    assert out == ["c", "d", ""] and text.stopped and text.finish() == ""


def test_an_incomplete_character_waits_for_the_next_token():
    model = ModelInfo("m", "", 100, frozenset(), _Chars("ab\ufffdé"))
    text = TextStream(model, ())
    assert text.push(0) == "a" and text.push(2) == "" and text.push(3) == "é" and text.finish() == ""
