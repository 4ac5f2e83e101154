"""Generation workloads for `quartctl load`: streamed requests whose prompt and output lengths come from the
trace, and the client-side TTFT/TPOT of each stream.

A request is a streamed ``POST /v1/completions`` (OpenAI's shape, ``prompt`` as a list of token ids) or a
streamed generation body on ``/function/<model>`` (``{"input_ids", "max_tokens", "stream"}``), always
with ``ignore_eos`` so the output has the length asked for. Lengths: the trace's ContextTokens and
GeneratedTokens (or fixed lengths for Poisson/gamma arrivals), times ``scale`` (``output_scale`` for the
output), then capped so the
output fits ``max_new_tokens`` and prompt + output fit ``max_context`` (see :func:`token_lengths`).

The client measures from the moment its request headers were written: TTFT = first token event, TPOT =
mean time between the later ones, ``(last − first) / (tokens − 1)``. :func:`generation_stats` (pure, the
math `quartctl report` and the load summary share) turns them into percentiles and SLO attainment.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np
from quart_tools.arrivals import Arrivals

DOORS = ("completions", "function")
PROMPT_ID_BASE, PROMPT_ID_SPAN = 32, 95  # printable ASCII ids: valid in every tokenizer the project serves


def door_of(url: str) -> str:
    """``completions`` for a ``…/v1/completions`` URL, ``function`` for ``…/function/<model>``."""
    path = urlsplit(url).path.rstrip("/")
    if path.endswith("/v1/completions"):
        return "completions"
    if "/function/" in path and path.rsplit("/function/", 1)[1]:
        return "function"
    raise ValueError(f"a generation load goes to …/v1/completions or …/function/<model>, not {url!r}")


def token_lengths(
    context: np.ndarray,
    generated: np.ndarray,
    *,
    scale: float = 1.0,
    output_scale: float | None = None,
    max_context: int = 2048,
    max_new_tokens: int = 256,
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, new tokens) per request, scaled to what the model and machine can do.

    new = clip(round(generated × output_scale), 1, max_new_tokens) (output_scale defaults to scale);
    prompt = clip(round(context × scale), 1, max_context − new), so every request fits the context.
    """
    output_scale = scale if output_scale is None else output_scale
    if scale <= 0 or output_scale <= 0:
        raise ValueError(f"the token scales must be positive, got {scale} and {output_scale}")
    if max_new_tokens < 1 or max_context < 2:
        raise ValueError(f"need max_new_tokens ≥ 1 and max_context ≥ 2, got {max_new_tokens} and {max_context}")
    new = np.clip(np.rint(np.asarray(generated, dtype=np.float64) * output_scale), 1, min(max_new_tokens, max_context - 1))
    prompt = np.clip(np.rint(np.asarray(context, dtype=np.float64) * scale), 1, max_context - new)
    return prompt.astype(np.int64), new.astype(np.int64)


def prompt_ids(n: int) -> list[int]:
    return [PROMPT_ID_BASE + (7 * i) % PROMPT_ID_SPAN for i in range(n)]


@dataclass
class GenerationWorkload:
    """What each request of a generation load asks for, and its body (built before the clock starts)."""

    door: str  # "completions" | "function"
    model: str
    prompt_tokens: np.ndarray
    max_tokens: np.ndarray
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.door not in DOORS:
            raise ValueError(f"unknown generation door {self.door!r}; one of {', '.join(DOORS)}")
        if self.door == "completions" and not self.model:
            raise ValueError("a /v1/completions load needs the model's name (--model)")
        self._bodies: dict[tuple[int, int], bytes] = {}
        for p, m in zip(self.prompt_tokens.tolist(), self.max_tokens.tolist(), strict=True):
            self.body(p, m)

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def body(self, prompt: int, max_tokens: int) -> bytes:
        key = (prompt, max_tokens)
        hit = self._bodies.get(key)
        if hit is None:
            ids = prompt_ids(prompt)
            if self.door == "completions":
                doc = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}, "temperature": self.temperature,
                       "ignore_eos": True}
            else:
                doc = {"input_ids": ids, "max_tokens": max_tokens, "stream": True,
                       "temperature": self.temperature, "ignore_eos": True}
            hit = self._bodies[key] = json.dumps(doc, separators=(",", ":")).encode()
        return hit

    def request(self, i: int) -> tuple[bytes, str]:
        return self.body(int(self.prompt_tokens[i]), int(self.max_tokens[i])), "application/json"


def make_workload(
    url: str,
    arrivals: Arrivals,
    *,
    model: str = "",
    scale: float = 1.0,
    output_scale: float | None = None,
    max_context: int = 2048,
    max_new_tokens: int = 256,
    prompt_tokens: int = 128,
    new_tokens: int = 32,
    temperature: float = 0.0,
) -> GenerationWorkload:
    """The workload for ``arrivals`` sent to ``url``: trace lengths when the arrivals carry them, else the
    fixed ``prompt_tokens`` / ``new_tokens``; both scaled and capped by :func:`token_lengths`."""
    door = door_of(url)
    n = len(arrivals)
    if arrivals.tokens is not None and arrivals.generated is not None:
        context, generated = arrivals.tokens, arrivals.generated
    else:
        context, generated = np.full(n, prompt_tokens), np.full(n, new_tokens)
    prompt, new = token_lengths(context, generated, scale=scale, output_scale=output_scale, max_context=max_context,
                                max_new_tokens=max_new_tokens)
    if door == "function" and not model:
        model = urlsplit(url).path.rstrip("/").rsplit("/function/", 1)[1]
    return GenerationWorkload(door, model, prompt, new, temperature)


@dataclass(slots=True)
class StreamTiming:
    """What one stream gave: tokens, TTFT and TPOT from the send, and the error event if one came."""

    tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    error: str | None


def _event_tokens(door: str, event: dict) -> tuple[int, bool, int | None, str | None]:
    """(token events in it, whether it ends the generation, tokens the server counted, error) of one
    SSE event."""
    if "error" in event:
        err = event["error"]
        return 0, False, None, (err.get("message") if isinstance(err, dict) else None) or str(err)
    counted = (event.get("usage") or {}).get("completion_tokens")
    if door == "function":
        return (1 if "token" in event else 0), "finish_reason" in event, counted, None
    choices = event.get("choices") or []
    text = "".join(c.get("text") or "" for c in choices)
    return (1 if text else 0), any(c.get("finish_reason") for c in choices), counted, None


async def read_stream(content, door: str, sent: float) -> StreamTiming:
    """Read an SSE body (an aiohttp ``StreamReader``) to its end; times from ``sent`` (perf_counter).

    A token whose text the server holds back (an incomplete UTF-8 sequence, a possible stop string) shows
    up with a later one, or at the finishing event: then that event's time counts as the token's.
    """
    first = last = finished = None
    events = 0
    counted: int | None = None
    error: str | None = None
    done = False
    while True:
        try:
            line = await content.readline()
        except ValueError as exc:  # aiohttp's line limit: a broken stream, not a token
            error = f"stream: {exc}"
            break
        if not line:
            break
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        try:
            event = json.loads(data)
        except ValueError:
            error = f"stream: an event that is not JSON: {data[:80]!r}"
            break
        if not isinstance(event, dict):
            error = f"stream: an event that is not an object: {data[:80]!r}"
            break
        n, ends, c, err = _event_tokens(door, event)
        now = time.perf_counter()
        if err is not None:
            error = f"stream error event: {err}"
        if c is not None:
            counted = int(c)
        if ends and finished is None:
            finished = now
        if n:
            first = now if first is None else first
            last = now
            events += n
    if error is None and not done:
        error = "stream: ended without data: [DONE]"
    tokens = counted if counted is not None else events
    if tokens > events and finished is not None:  # held-back text came with the finishing event
        first = finished if first is None else first
        last = finished
    ttft = (first - sent) * 1000.0 if first is not None else None
    tpot = (last - first) * 1000.0 / (tokens - 1) if first is not None and tokens > 1 and last > first else None
    return StreamTiming(tokens, ttft, tpot, error)


GEN_PERCENTILES: tuple[int, ...] = (50, 90, 99)


def generation_stats(
    ttft_ms: Sequence[float] | np.ndarray,
    tpot_ms: Sequence[float] | np.ndarray,
    ok: Sequence[bool] | np.ndarray,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
) -> dict:
    """TTFT/TPOT percentiles (p50/p90/p99 of the successful streams) and SLO attainment over ALL requests.

    A failed request (``ok`` false, or no first token) misses both SLOs. A successful stream of one
    token has no TPOT: it meets the TPOT SLO (no later token was late). ``slo_attainment`` counts the
    requests that meet both SLOs given.
    """
    ttft = np.asarray(ttft_ms, dtype=np.float64)
    tpot = np.asarray(tpot_ms, dtype=np.float64)
    good = np.asarray(ok, dtype=bool) & ~np.isnan(ttft)
    out: dict = {"requests": int(len(ttft)), "completed": int(good.sum())}
    for name, values in (("ttft", ttft[good]), ("tpot", tpot[good & ~np.isnan(tpot)])):
        for q, v in zip(GEN_PERCENTILES, np.percentile(values, GEN_PERCENTILES) if len(values) else
                        [math.nan] * len(GEN_PERCENTILES), strict=True):
            out[f"{name}_p{q}_ms"] = float(v)
    total = len(ttft)
    met = good.copy()
    for name, values, slo in (("ttft", ttft, ttft_slo_ms), ("tpot", tpot, tpot_slo_ms)):
        if slo is None:
            continue
        if slo <= 0:
            raise ValueError(f"the {name.upper()} SLO must be positive, got {slo}")
        within = good & ((values <= slo) if name == "ttft" else (np.isnan(values) | (values <= slo)))
        out[f"{name}_slo_ms"] = float(slo)
        out[f"{name}_slo_attainment"] = float(within.sum()) / total if total else math.nan
        met &= within
    if ttft_slo_ms is not None or tpot_slo_ms is not None:
        out["slo_attainment"] = float(met.sum()) / total if total else math.nan
    return out


def records_generation(records) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(ttft_ms, tpot_ms, ok) of generation records (NaN where absent); None when no record is one."""
    if not any(r.prompt_tokens is not None for r in records):
        return None
    nan = math.nan
    ttft = np.array([nan if r.ttft_ms is None else r.ttft_ms for r in records], dtype=np.float64)
    tpot = np.array([nan if r.tpot_ms is None else r.tpot_ms for r in records], dtype=np.float64)
    return ttft, tpot, np.array([r.ok for r in records], dtype=bool)
