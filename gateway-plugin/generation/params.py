"""A generation request's parameters, checked before anything is tokenized or expanded. Pure.

The same rules for the three doors: ``/v1/completions``, ``/v1/chat/completions`` (OpenAI's fields) and a
generation body on ``POST /function/<model>`` (:func:`is_generation` says which bodies are). Every
refusal is a :class:`~quart_stage.errors.QuartError` 400 naming the field. Fields this gateway does not
implement and that change the answer (``n`` > 1, ``logprobs``, ``tools``...) are refused, never ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gateway_plugin.generation.config import GenerationConfig
from quart_stage.errors import invalid

ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_TOKEN_ID = 2**31 - 1
UNSUPPORTED = ("tools", "functions", "function_call", "suffix", "response_format", "audio", "prediction",
               "reasoning_effort", "verbosity", "web_search_options", "parallel_tool_calls", "metadata",
               "prompt_cache_options", "prompt_cache_retention", "moderation")
NONE_VALUES = ("tools", "functions", "parallel_tool_calls", "metadata")  # [], {} or false: nothing asked
HONOURED = {  # the fields each /v1 door reads; any other is refused by name (never ignored)
    "both": {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
             "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "store", "service_tier",
             "user", "safety_identifier", "prompt_cache_key",  # identifiers and hints: no effect on the answer
             "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",  # vLLM's
             "include_stop_str_in_output"},
    "chat": {"messages", "max_completion_tokens", "top_logprobs", "tool_choice", "modalities"},
    "completion": {"prompt", "best_of", "echo"},
}
OPENAI_ONLY = ("logprobs", "top_logprobs", "echo")  # refused on the native door (its answer has no place for them)
MAX_CHOICES = 64  # sessions one request may open: prompts × best_of (or n)
MAX_LOGPROBS = 20  # vLLM's bound (OpenAI's: 20 for chat, 5 for completions)
MAX_BIASES = 300  # logit_bias entries (OpenAI's bound); they travel in the sample header


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What to generate: exactly one of ``prompt``, ``prompt_ids``, ``messages``; sampling and stopping."""

    model: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, text)
    max_tokens: int | None = None  # None: the door's default, bounded by the context
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # None: the gateway draws one (a replay must sample the same tokens)
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    top_k: int = 0  # 0: off (vLLM's -1 too)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension
    min_tokens: int = 0  # vLLM's extension: no EOS, stop id or stop string before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's extension
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely
    echo: bool = False  # completions: the prompt's text before the completion
    n: int = 1  # choices per prompt
    best_of: int | None = None  # completions: sessions per prompt, the n with the highest logprob sum answered
    more_prompts: tuple[str | tuple[int, ...], ...] = ()  # completions: a list's prompts after the first

    @property
    def runs(self) -> int:
        """Sessions per prompt."""
        return self.best_of or self.n

    def prompts(self) -> list[GenerationParams]:
        """One GenerationParams per prompt of a list (itself for one prompt)."""
        out = [self]
        for item in self.more_prompts:
            text = item if isinstance(item, str) else None
            out.append(replace(self, prompt=text, prompt_ids=None if text is not None else item, more_prompts=()))
        return out

    def sample(self, prompt_len: int, eos: frozenset[int]) -> dict[str, Any]:
        """The last stage's sampling parameters for a prompt of ``prompt_len`` tokens whose generation ends at
        the ids ``eos`` (quart_stage.sampling; the history the penalties read is added per step)."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        extra = {"top_k": self.top_k, "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                 "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty}
        out.update({k: v for k, v in extra.items() if v != GenerationParams.__dataclass_fields__[k].default})
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
            if self.echo:
                out["prompt_logprobs"] = self.logprobs
        if self.logit_bias:
            out["logit_bias"] = {str(i): b for i, b in self.logit_bias}
        suppress = sorted((set() if self.ignore_eos else set(eos)) | set(self.stop_ids))
        if self.min_tokens and suppress:
            out.update(min_pos=prompt_len + self.min_tokens, suppress=suppress)
        return out

    @property
    def prompt_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(text) for _, text in self.messages or ())


def is_generation(doc: Any) -> bool:
    """Whether a JSON body on ``POST /function/<model>`` asks for generation: it names ``prompt``,
    ``max_tokens`` or ``stream``, or its ``input_ids`` is one flat list of integers. A one-shot pass
    (``input_ids`` as a matrix, ``text``, anything else) keeps the router's one-shot path."""
    if not isinstance(doc, dict):
        return False
    if any(k in doc for k in ("prompt", "max_tokens", "stream")):
        return True
    ids = doc.get("input_ids")
    return isinstance(ids, list) and bool(ids) and all(isinstance(i, int) for i in ids)


def parse(doc: Any, door: str, cfg: GenerationConfig, model: str | None = None) -> GenerationParams:
    """The parameters of ``doc`` for ``door`` (``completion``, ``chat`` or ``native``; ``model`` given for the
    native door, where the path names it)."""
    if not isinstance(doc, dict):
        raise invalid("body", "the request body must be a JSON object")
    name = model if model is not None else doc.get("model")
    if not isinstance(name, str) or not name:
        raise invalid("model", "model must name a deployed pipeline (GET /v1/models lists them)")
    if door != "native":
        _known_fields(doc, door)
    if doc.get("tool_choice") not in (None, "none"):  # "none": no tool is called (what LangChain sends)
        raise invalid("tool_choice", f"tool_choice {doc['tool_choice']!r} is not supported by this gateway (no tools); "
                                     "only \"none\"")
    for key in UNSUPPORTED:
        value = doc.get(key)
        if value is None or (key in NONE_VALUES and value in (False, [], {})) or (
                key == "response_format" and _text_format(value)):
            continue
        raise invalid(key, f"{key} is not supported by this gateway")
    if door == "native":
        for key in OPENAI_ONLY:
            if doc.get(key) not in (None, False):
                raise invalid(key, f"{key} is answered on /v1 only (OpenAI's shapes); use /v1/completions")
    logprobs, echo = _logprobs(doc, door)
    n, best_of = _choices(doc, door)
    prompt, prompt_ids, messages, more = None, None, None, ()
    if door == "chat":
        messages = _messages(doc.get("messages"), cfg)
    elif door == "completion":
        items = _prompt_list(doc.get("prompt"))
        prompt, prompt_ids = items[0]
        more = tuple(text if text is not None else ids for text, ids in items[1:])
        chars = sum(len(text or "") for text, _ in items)
        if chars > cfg.max_prompt_chars:
            raise invalid("prompt", f"the prompts have {chars} characters; at most {cfg.max_prompt_chars}", 413)
        if len(items) * (best_of or n) > MAX_CHOICES:
            raise invalid("prompt", f"{len(items)} prompts × {best_of or n} choices: at most {MAX_CHOICES} in one "
                                    "request", 413)
    else:
        if "prompt" in doc and "input_ids" in doc:
            raise invalid("prompt", "give prompt or input_ids, not both")
        prompt, prompt_ids = _prompt(doc["input_ids"] if "input_ids" in doc else doc.get("prompt"),
                                     "input_ids" if "input_ids" in doc else "prompt")
    if prompt is not None and len(prompt) > cfg.max_prompt_chars:
        raise invalid("prompt", f"the prompt has {len(prompt)} characters; at most {cfg.max_prompt_chars}", 413)
    max_tokens = doc.get("max_completion_tokens") if doc.get("max_tokens") is None else doc.get("max_tokens")
    least = 0 if door == "completion" and doc.get("echo") is True else 1  # 0 with echo: the prompt's logprobs only
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < least):
        raise invalid("max_tokens", f"max_tokens must be an integer of at least {least}, got {max_tokens!r}")
    default_t = 0.0 if door == "native" else 1.0
    temperature = _number(doc, "temperature", default_t, 0.0, 2.0)
    top_p = _number(doc, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise invalid("top_p", "top_p must be above 0")
    seed = doc.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise invalid("seed", f"seed must be a 64-bit integer, got {seed!r}")
    stop, stop_ids = _stops(doc.get("stop"), doc.get("stop_token_ids"))
    stream = doc.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", f"stream must be true or false, got {stream!r}")
    ignore_eos = doc.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("ignore_eos", f"ignore_eos must be true or false, got {ignore_eos!r}")
    top_k = doc.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise invalid("top_k", f"top_k must be an integer: -1 or 0 for off, else at least 1; got {top_k!r}")
    min_tokens = doc.get("min_tokens")
    if min_tokens is not None and (not _is_int(min_tokens) or min_tokens < 0):
        raise invalid("min_tokens", f"min_tokens must be a non-negative integer, got {min_tokens!r}")
    if min_tokens and max_tokens is not None and min_tokens > max_tokens:
        raise invalid("min_tokens", f"min_tokens {min_tokens} is above max_tokens {max_tokens}")
    repetition = _number(doc, "repetition_penalty", 1.0, 0.0, 2.0)
    if repetition <= 0.0:
        raise invalid("repetition_penalty", "repetition_penalty must be above 0")
    include_stop = doc.get("include_stop_str_in_output", False)
    if include_stop is not None and not isinstance(include_stop, bool):
        raise invalid("include_stop_str_in_output", "include_stop_str_in_output must be true or false")
    options = doc.get("stream_options") or {}
    if not isinstance(options, Mapping) or not isinstance(options.get("include_usage", False), bool):
        raise invalid("stream_options", "stream_options must be an object with a boolean include_usage")
    return GenerationParams(
        model=name, prompt=prompt, prompt_ids=prompt_ids, messages=messages, max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, seed=seed, stop=stop, stop_ids=stop_ids, stream=stream,
        include_usage=bool(options.get("include_usage", False)), ignore_eos=ignore_eos,
        top_k=max(0, top_k or 0), min_p=_number(doc, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(doc, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(doc, "frequency_penalty", 0.0, -2.0, 2.0), repetition_penalty=repetition,
        min_tokens=min_tokens or 0, logit_bias=_biases(doc.get("logit_bias")), include_stop_str_in_output=bool(include_stop),
        logprobs=logprobs, echo=echo, n=n, best_of=best_of, more_prompts=more,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _known_fields(doc: Mapping, door: str) -> None:
    """400 naming the first field of ``doc`` that door ``door`` does not honour, or a value of a field it honours
    only in part (``store`` true, a ``service_tier`` other than auto / default, ``modalities`` other than text)."""
    for key, value in doc.items():
        if value is None:
            continue
        if key not in HONOURED["both"] | HONOURED[door] and key not in UNSUPPORTED:
            raise invalid(str(key)[:100], f"field {str(key)[:100]!r} is not supported by this gateway")
    if doc.get("store") not in (None, False):
        raise invalid("store", "store: this gateway does not store completions")
    if doc.get("service_tier") not in (None, "auto", "default"):
        raise invalid("service_tier", f"service_tier {doc['service_tier']!r}: this gateway has one tier (auto)")
    if doc.get("modalities") not in (None, ["text"]):
        raise invalid("modalities", "modalities: this gateway answers text only ([\"text\"])")
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise invalid(key, f"{key} must be a string")
    options = doc.get("stream_options")
    if isinstance(options, Mapping):
        for key, value in options.items():
            if key == "include_obfuscation" and value in (False, None):
                continue
            if key != "include_usage":
                raise invalid(f"stream_options.{str(key)[:60]}", f"stream_options.{str(key)[:60]} is not supported "
                                                                   "by this gateway")


def _choices(doc: Mapping, door: str) -> tuple[int, int | None]:
    """(n, best_of) checked: best_of (completions) at least n, not streamed beyond n (OpenAI's rules)."""
    n = doc.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"n must be an integer in 1..{MAX_CHOICES}, got {n!r}")
    if door == "native" and n != 1:
        raise invalid("n", "n > 1 is answered on /v1 only (OpenAI's choices)")
    best_of = doc.get("best_of")
    if best_of is None:
        return n, None
    if door != "completion":
        raise invalid("best_of", "best_of is a /v1/completions field")
    if not _is_int(best_of) or not n <= best_of <= MAX_CHOICES:
        raise invalid("best_of", f"best_of must be an integer in n..{MAX_CHOICES} (n = {n}), got {best_of!r}")
    if best_of > n and doc.get("stream"):
        raise invalid("best_of", "best_of > n cannot be streamed (the best are known only at the end)")
    return n, best_of


def _prompt_list(value: Any) -> list[tuple[str | None, tuple[int, ...] | None]]:
    """A completion's prompts: one string or id list, or a list of them (OpenAI's batch)."""
    if isinstance(value, list) and value and all(isinstance(v, str) or isinstance(v, list) for v in value):
        if len(value) > MAX_CHOICES:
            raise invalid("prompt", f"{len(value)} prompts; at most {MAX_CHOICES} in one request", 413)
        return [_prompt(v, f"prompt[{i}]") for i, v in enumerate(value)]
    return [_prompt(value, "prompt")]


def _logprobs(doc: Mapping, door: str) -> tuple[int | None, bool]:
    """(how many top logprobs per token, None for none; echo) as the door spells them."""
    value, top = doc.get("logprobs"), doc.get("top_logprobs")
    if door == "chat":
        if value is not None and not isinstance(value, bool):
            raise invalid("logprobs", f"logprobs must be true or false on chat, got {value!r}")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
            raise invalid("top_logprobs", f"top_logprobs must be an integer in 0..{MAX_LOGPROBS}, got {top!r}")
        if top and not value:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
        if doc.get("echo") not in (None, False):
            raise invalid("echo", "echo is a /v1/completions field")
        return (top or 0) if value else None, False
    if top is not None:
        raise invalid("top_logprobs", "top_logprobs is a chat field; /v1/completions takes logprobs: k")
    value = None if value is False else value  # false: none (as chat spells it)
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise invalid("logprobs", f"logprobs must be an integer in 0..{MAX_LOGPROBS} on completions, got {value!r}")
    echo = doc.get("echo", False)
    if echo is not None and not isinstance(echo, bool):
        raise invalid("echo", f"echo must be true or false, got {echo!r}")
    if echo and value is not None and doc.get("stream"):
        raise invalid("echo", "echo with logprobs is answered unstreamed (the prompt's logprobs come with the prefill)")
    return value, bool(echo)


def _biases(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping) or len(value) > MAX_BIASES:
        raise invalid("logit_bias", f"logit_bias must be an object of at most {MAX_BIASES} token id -> bias entries")
    out = []
    for key, bias in value.items():
        ok = isinstance(key, str) and key.isdigit() and int(key) <= MAX_TOKEN_ID
        if not ok or isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias) \
                or not -100 <= bias <= 100:
            raise invalid("logit_bias", f"logit_bias maps token ids to numbers in [-100, 100], got {key!r}: {bias!r}")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _text_format(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("type") == "text"


def _number(doc: Mapping, key: str, default: float, low: float, high: float) -> float:
    value = doc.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(key, f"{key} must be a number, got {value!r}")
    if not low <= value <= high:
        raise invalid(key, f"{key} must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _prompt(value: Any, field: str) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # OpenAI's batch of one prompt
    if isinstance(value, str):
        if not value:
            raise invalid(field, f"{field} is empty")
        return value, None
    if isinstance(value, list) and value and all(_is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in value):
        return None, tuple(value)
    raise invalid(field, f"{field} must be a non-empty string or a list of token ids (or, on /v1/completions, a "
                         "list of those)")


def _messages(value: Any, cfg: GenerationConfig) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "messages must be a non-empty list of {role, content}")
    if len(value) > cfg.max_messages:
        raise invalid("messages", f"{len(value)} messages; at most {cfg.max_messages}", 413)
    out, chars = [], 0
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise invalid(where, f"{where} must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        if message.get("tool_calls"):
            raise invalid(f"{where}.tool_calls", f"{where}.tool_calls: tool calls are not supported by this gateway")
        content = message.get("content")
        text = "" if content is None and role == "assistant" else _content(content, where)  # OpenAI: null with tools
        chars += len(text)
        if chars > cfg.max_prompt_chars:
            raise invalid("messages", f"the messages hold more than {cfg.max_prompt_chars} characters", 413)
        out.append(("system" if role == "developer" else role, text))
    return tuple(out)


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content", f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}}")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"{where}.content", f"{where}.content must be a string or a list of text parts")


def _stops(stop: Any, stop_token_ids: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    items = [] if stop is None else [stop] if isinstance(stop, str | int) and not isinstance(stop, bool) else stop
    if not isinstance(items, list) or len(items) > MAX_STOPS:
        raise invalid("stop", f"stop must be a string or a list of at most {MAX_STOPS}")
    ids = [] if stop_token_ids is None else stop_token_ids
    if not isinstance(ids, list) or len(ids) > MAX_STOPS or not all(_is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in ids):
        raise invalid("stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOPS} token ids")
    texts: list[str] = []
    for item in items:
        if _is_int(item) and 0 <= item <= MAX_TOKEN_ID:  # a token id (the native door's "stop strings/ids")
            ids.append(item)
        elif isinstance(item, str) and 0 < len(item) <= MAX_STOP_CHARS:
            texts.append(item)
        else:
            raise invalid("stop", f"each stop must be a non-empty string of at most {MAX_STOP_CHARS} characters "
                                  f"or a token id, got {item!r}")
    return tuple(texts), tuple(ids)
