"""Choosing the next token from the last position's logits (the last stage of a generation session). Pure.

The logits are first adjusted, in vLLM's order: ``min_tokens`` (the stop ids are impossible while the token
drawn is before ``min_pos``), ``logit_bias`` (added), then the penalties — ``repetition_penalty`` over every id
of the history (prompt and generated: a positive logit divided by it, a negative one multiplied), then
``frequency_penalty`` × the count and ``presence_penalty`` × (count > 0) of each id the session generated,
subtracted. Greedy (temperature 0): argmax of the adjusted logits, ties to the lowest id. Sampling
(temperature > 0): softmax of ``adjusted / temperature``, then ``min_p`` (tokens below ``min_p`` × the top
probability dropped), ``top_k``, ``top_p`` (nucleus, of what is left), then one draw whose random number is a
pure function of ``(seed, position)`` — the absolute position of the token drawn — so a replay of a session
on another replica gives the same tokens. With ``logprobs`` ≥ 0 the answer also carries the chosen token's
log-probability and the ``logprobs`` most likely ones, of the model's raw distribution (vLLM's default).

Parameters arrive as the JSON header ``X-Quart-Sample`` (a batched step: its table's ``sample``). The history
the penalties read travels with them (``history``: base64 of little-endian int32 ids, its first
``prompt_len`` the prompt's), so every step is a pure function of its request (docs/generation.md#sampling).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from quart_stage.errors import invalid

H_SAMPLE = "X-Quart-Sample"
FIELD = "sample"
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63
MAX_LOGPROBS = 20
MAX_BIAS = 100.0
MAX_PENALTY = 2.0  # presence and frequency: OpenAI's [-2, 2]
MAX_REPETITION = 10.0
KEYS = ("temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "min_pos", "suppress", "history", "prompt_len", "logprobs",
        "prompt_logprobs")
_EMPTY = torch.empty(0, dtype=torch.long)


@dataclass(frozen=True, eq=False)
class SampleParams:
    """How the last stage picks a token: greedy when ``temperature`` is 0 (see the module's docstring)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_pos: int = 0  # a token drawn at a position below this is never one of ``suppress`` (min_tokens)
    suppress: tuple[int, ...] = ()
    history: torch.Tensor = field(default_factory=lambda: _EMPTY)  # ids the penalties read (int64)
    prompt_len: int = 0  # the first ``prompt_len`` ids of ``history`` are the prompt's
    logprobs: int = -1  # -1: none; k >= 0: the chosen token's logprob and the top k
    prompt_logprobs: int = -1  # -1: none; k >= 0: each prompt token's logprob (from the 2nd) and the top k

    def prompt_span(self, pos: int, new: int) -> range:
        """The prompt tokens whose logprobs a step of ``new`` positions after ``pos`` gives (token t's logits are
        position t - 1's): none unless ``prompt_logprobs`` is asked."""
        if self.prompt_logprobs < 0:
            return range(0)
        return range(pos + 1, min(pos + new + 1, self.prompt_len))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_logits(self, emulated: bool) -> None:
        """400 when emulated compute (no logits) is asked for logprobs, which it cannot answer."""
        if emulated and (self.logprobs >= 0 or self.prompt_logprobs >= 0):
            raise invalid(FIELD, "logprobs: emulated compute has no logits to answer them from")

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before the choice (a penalty, a bias, a suppressed id)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or (self.suppress and self.min_pos > 0))


GREEDY = SampleParams()


def parse_sample(raw: str | None) -> SampleParams:
    """The ``X-Quart-Sample`` header (a JSON object, every key optional) as SampleParams; 400 naming what is wrong."""
    if raw is None or not raw.strip():
        return GREEDY
    try:
        doc = json.loads(raw)
    except ValueError:
        raise invalid(FIELD, f'{H_SAMPLE} must be a JSON object like {{"temperature": 0.7, "seed": 1}}') from None
    if not isinstance(doc, dict):
        raise invalid(FIELD, f"{H_SAMPLE} must be a JSON object")
    return sample_from(doc)


def sample_from(doc: dict) -> SampleParams:
    """SampleParams from a decoded ``X-Quart-Sample`` object; 400 naming what is wrong."""
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise invalid(FIELD, f"{H_SAMPLE}: unknown key {unknown[0]!r}; expected {', '.join(KEYS)}")
    temperature = _number(doc, "temperature", 0.0, 0.0, MAX_TEMPERATURE)
    top_p = _number(doc, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise invalid(FIELD, f"top_p must be in (0, 1], got {top_p}")
    repetition = _number(doc, "repetition_penalty", 1.0, 0.0, MAX_REPETITION)
    if repetition <= 0.0:
        raise invalid(FIELD, f"repetition_penalty must be in (0, {MAX_REPETITION:g}], got {repetition}")
    seed = _integer(doc, "seed", 0)
    if not 0 <= seed < MAX_SEED:
        raise invalid(FIELD, f"seed must be in [0, 2**63), got {seed}")
    history = _history(doc.get("history"))
    prompt_len = _integer(doc, "prompt_len", 0)
    if not 0 <= prompt_len <= len(history):
        raise invalid(FIELD, f"prompt_len must be in [0, {len(history)}] (the history's length), got {prompt_len}")
    logprobs, prompt_logprobs = _integer(doc, "logprobs", -1), _integer(doc, "prompt_logprobs", -1)
    if not -1 <= logprobs <= MAX_LOGPROBS or not -1 <= prompt_logprobs <= MAX_LOGPROBS:
        raise invalid(FIELD, f"logprobs and prompt_logprobs must be in [-1, {MAX_LOGPROBS}] (-1 = none), got "
                             f"{logprobs}, {prompt_logprobs}")
    top_k = _integer(doc, "top_k", 0)
    if top_k < 0:
        raise invalid(FIELD, f"top_k must be >= 0 (0 = off), got {top_k}")
    min_pos = _integer(doc, "min_pos", 0)
    if min_pos < 0:
        raise invalid(FIELD, f"min_pos must be >= 0, got {min_pos}")
    return SampleParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        min_p=_number(doc, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(doc, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(doc, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=repetition, logit_bias=_bias(doc.get("logit_bias")), min_pos=min_pos,
        suppress=_ids(doc.get("suppress"), "suppress"), history=history, prompt_len=prompt_len, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs)


def _history(value) -> torch.Tensor:
    if value is None or value == "":
        return _EMPTY
    if not isinstance(value, str):
        raise invalid(FIELD, "history must be a base64 string of little-endian int32 token ids")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(FIELD, "history must be a base64 string of little-endian int32 token ids") from None
    if len(raw) % 4:
        raise invalid(FIELD, f"history holds {len(raw)} bytes: not a whole number of int32 ids")
    ids = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int64))
    if len(ids) and int(ids.min()) < 0:
        raise invalid(FIELD, "history holds a negative token id")
    return ids


def _number(doc: dict, name: str, default: float, low: float, high: float) -> float:
    value = doc.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(FIELD, f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise invalid(FIELD, f"{name} must be in [{low:g}, {high:g}], got {value}")
    return float(value)


def _integer(doc: dict, name: str, default: int) -> int:
    value = doc.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(FIELD, f"{name} must be an integer, got {value!r}")
    return value


def _ids(value, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise invalid(FIELD, f"{name} must be a list of token ids")
    return tuple(value)


def _bias(value) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid(FIELD, "logit_bias must be an object of token id -> bias")
    out = []
    for key, bias in value.items():
        if not str(key).isdigit() or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise invalid(FIELD, f"logit_bias maps token ids to numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                 f"got {key!r}: {bias!r}")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on (seed, position)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / float(1 << 53)


def adjusted(logits: torch.Tensor, params: SampleParams, position: int) -> torch.Tensor:
    """The logits (1-D, vocab; float32 on the CPU) after min_tokens, logit_bias and the penalties."""
    x = logits.float().cpu().clone()
    vocab = x.shape[-1]
    if position < params.min_pos and params.suppress:
        ids = torch.tensor([i for i in params.suppress if i < vocab], dtype=torch.long)
        x[ids] = -math.inf
    if params.logit_bias:
        ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long)
        if int(ids.max()) >= vocab:
            raise invalid("logit_bias", f"logit_bias names token id {int(ids.max())}; the vocabulary has {vocab}")
        x[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
    history = params.history
    if len(history) and int(history.max()) >= vocab:
        raise invalid(FIELD, f"history holds token id {int(history.max())}; the vocabulary has {vocab}")
    if params.repetition_penalty != 1.0 and len(history):
        seen = torch.unique(history)
        scores = x[seen]
        x[seen] = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        counts = torch.bincount(history[params.prompt_len:], minlength=vocab).float()
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return x


def _kept(x: torch.Tensor, params: SampleParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, ids) of the tokens sampling may draw, most likely first (not renormalised)."""
    probs = torch.softmax(x / params.temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    if params.min_p > 0.0:
        keep = max(1, int((sorted_probs >= params.min_p * sorted_probs[0]).sum()))
        sorted_probs, order = sorted_probs[:keep], order[:keep]
    if params.top_k:
        sorted_probs, order = sorted_probs[: params.top_k], order[: params.top_k]
    if params.top_p < 1.0:
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above each one
        total = float(sorted_probs.sum()) if params.top_k or params.min_p > 0.0 else 1.0  # of what is left
        keep = max(1, int((before < params.top_p * total).sum()))  # the smallest head whose mass reaches top_p
        sorted_probs, order = sorted_probs[:keep], order[:keep]
    return sorted_probs, order


def distribution(logits: torch.Tensor, params: SampleParams, position: int) -> torch.Tensor:
    """The probability of each token (1-D, vocab) that ``choose`` draws from at ``position`` (temperature > 0)."""
    probs, order = _kept(adjusted(logits, params, position), params)
    out = torch.zeros(logits.shape[-1], dtype=torch.float64)
    out[order] = probs.double() / float(probs.double().sum())
    return out


def choose(logits: torch.Tensor, params: SampleParams, position: int) -> int:
    """The token for absolute ``position`` from that position's logits (1-D, vocab)."""
    if params.greedy:
        x = adjusted(logits, params, position) if params.adjusts else logits
        return int(torch.argmax(x))  # the first maximum: ties go to the lowest id
    x = adjusted(logits, params, position) if params.adjusts else logits.float().cpu()  # the same draw anywhere
    sorted_probs, order = _kept(x, params)
    cdf = torch.cumsum(sorted_probs.double(), dim=-1)
    target = uniform(params.seed, position) * float(cdf[-1])
    index = min(int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True)), len(cdf) - 1)
    return int(order[index])


def logprobs(logits: torch.Tensor, token: int, k: int) -> dict:
    """The chosen token's log-probability and the ``k`` most likely tokens' (``{"logprob", "top": [[id, lp]...]}``),
    of the model's raw distribution (before penalties and temperature, as vLLM reports by default)."""
    lp = torch.log_softmax(logits.float().cpu(), dim=-1)
    out: dict = {"logprob": float(lp[token])}
    if k > 0:
        values, ids = torch.topk(lp, min(k, lp.shape[-1]))
        out["top"] = [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return out


def answer(logits: torch.Tensor, params: SampleParams, position: int) -> dict:
    """The last stage's answer for one position: ``{"token"}``, with ``logprob`` and ``top`` when asked."""
    token = choose(logits, params, position)
    doc: dict = {"token": token}
    if params.logprobs >= 0:
        doc.update(logprobs(logits, token, params.logprobs))
    return doc


def prompt_answer(rows: torch.Tensor, params: SampleParams, pos: int) -> dict:
    """The answer of a step whose head ran on every new position (``rows``: [new, vocab], the first at ``pos``):
    the next token, and ``{"prompt_from": t0, "prompt": [{"logprob", "top"?}...]}`` for the prompt tokens t0...
    (:meth:`SampleParams.prompt_span`), read from ``history``."""
    new = rows.shape[0]
    doc = answer(rows[-1], params, pos + new)
    span = params.prompt_span(pos, new)
    if len(span):
        doc["prompt_from"] = span.start
        doc["prompt"] = [logprobs(rows[t - 1 - pos], int(params.history[t]), params.prompt_logprobs) for t in span]
    return doc
