"""Choosing the next token from the last position's logits (the last stage of a generation session).

Greedy (temperature 0): argmax, ties to the lowest id. Sampling (temperature > 0): softmax of
``logits / temperature``, top-k then top-p (nucleus) filtering, then one draw whose random number is a
pure function of ``(seed, position)`` — the absolute position of the token drawn — so a replay of a
session on another replica gives the same tokens. Parameters arrive as the JSON header ``X-Quart-Sample``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import torch

from quart_stage.errors import invalid

H_SAMPLE = "X-Quart-Sample"
FIELD = "sample"
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63


@dataclass(frozen=True)
class SampleParams:
    """How the last stage picks a token: greedy when ``temperature`` is 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    unknown = sorted(set(doc) - {"temperature", "top_p", "top_k", "seed"})
    if unknown:
        raise invalid(FIELD, f"{H_SAMPLE}: unknown key {unknown[0]!r}; expected temperature, top_p, top_k, seed")
    temperature = _number(doc.get("temperature", 0.0), "temperature")
    top_p = _number(doc.get("top_p", 1.0), "top_p")
    top_k, seed = _integer(doc.get("top_k", 0), "top_k"), _integer(doc.get("seed", 0), "seed")
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise invalid(FIELD, f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise invalid(FIELD, f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise invalid(FIELD, f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 <= seed < MAX_SEED:
        raise invalid(FIELD, f"seed must be in [0, 2**63), got {seed}")
    return SampleParams(float(temperature), float(top_p), top_k, seed)


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(FIELD, f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(FIELD, f"{name} must be an integer, got {value!r}")
    return value


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on (seed, position)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / float(1 << 53)


def choose(logits: torch.Tensor, params: SampleParams, position: int) -> int:
    """The token for absolute ``position`` from that position's logits (1-D, vocab)."""
    if params.greedy:
        return int(torch.argmax(logits))  # the first maximum: ties go to the lowest id
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)  # the same draw on any device
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    if params.top_k:
        sorted_probs = sorted_probs[: params.top_k]
    if params.top_p < 1.0:
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs = sorted_probs[before < params.top_p]  # the smallest head whose mass reaches top_p
    cdf = torch.cumsum(sorted_probs.double(), dim=-1)
    target = uniform(params.seed, position) * float(cdf[-1])
    index = min(int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True)), len(cdf) - 1)
    return int(order[index])
