"""Generation sessions on a stage replica: prefill once, then one-position decode steps (docs/generation.md).

A request with ``X-Quart-Session`` carries only a session's new positions. The stage appends them to the
session's KV cache for its own layers (:mod:`quart_stage.kvcache`), runs its layers over them, and answers
their ``hidden_states`` for the next stage; the last stage answers one sampled token as JSON
(:mod:`quart_stage.sampling`). Emulated compute keeps the same bookkeeping, sleeps a prefill or decode
time (:class:`quart_stage.emulated.StepTime`) and answers tokens that are a hash of the session's ids.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from quart_stage import wire
from quart_stage.errors import QuartError, invalid
from quart_stage.inputs import ATTENTION_MASK, HIDDEN, INPUT_IDS, SEGMENT_LENGTHS
from quart_stage.kvcache import (
    FIELD,
    H_KV_TOKENS,
    H_SESSION,
    H_SESSION_END,
    H_SESSION_POS,
    H_SESSION_RESERVE,
    SessionTable,
)
from quart_stage.kvmigrate import EmulatedKV, block_layers
from quart_stage.layers import H_LAYERS, fmt, range_share
from quart_stage.response import H_COMPUTE, H_DESER, H_REQUEST_ID, H_SER, JSON_TYPE, StageResponse, elapsed_ms
from quart_stage.sampling import H_SAMPLE, SampleParams, answer, parse_sample, prompt_answer
from quart_stage.sessionbatch import BatchedSteps

H_RETURN_LOGITS = "X-Quart-Return-Logits"
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
KV_BUDGET_BYTES = 1 << 30
"""QUART_KV_MAX_TOKENS=0 (auto): as many positions as this many bytes of the stage's K/V hold ..."""
KV_AUTO_MIN, KV_AUTO_MAX, KV_AUTO_UNKNOWN = 1024, 65536, 16384
"""... clamped to [min, max]; a parameter-free emulated stage (no config) gets KV_AUTO_UNKNOWN."""
EMULATED_VOCAB = 32000
_DIGITS = 3  # an emulated activation carries each position's token id as base-256 digits in its first columns


@dataclass(frozen=True)
class SessionRequest:
    """The session headers of one request."""

    id: str
    pos: int
    reserve: int
    end: bool
    sample: SampleParams
    return_logits: bool


def parse_session(headers: Mapping[str, str]) -> SessionRequest:
    """The session headers (lower-case keys) of a request that has ``X-Quart-Session``; 400 naming what is wrong."""
    sid = headers[H_SESSION.lower()]
    if not SESSION_ID.fullmatch(sid):
        raise invalid(FIELD, f"{H_SESSION} must be 1..128 characters of A-Z a-z 0-9 . _ : -, got {sid[:140]!r}")
    return SessionRequest(
        id=sid, pos=count_header(headers.get(H_SESSION_POS.lower()), H_SESSION_POS, required=True),
        reserve=count_header(headers.get(H_SESSION_RESERVE.lower()), H_SESSION_RESERVE),
        end=_flag(headers.get(H_SESSION_END.lower()), H_SESSION_END),
        sample=parse_sample(headers.get(H_SAMPLE.lower())),
        return_logits=_flag(headers.get(H_RETURN_LOGITS.lower()), H_RETURN_LOGITS))


def count_header(raw: str | None, name: str, required: bool = False) -> int:
    if raw is None:
        if required:
            raise invalid(FIELD, f"{name} is required with {H_SESSION} (0 for a new session)")
        return 0
    if not raw.strip().isdigit() or len(raw.strip()) > 12:
        raise invalid(FIELD, f"{name} must be a non-negative integer, got {raw[:40]!r}")
    return int(raw)


def _flag(raw: str | None, name: str) -> bool:
    if raw is None:
        return False
    if raw.strip() not in ("0", "1"):
        raise invalid(FIELD, f"{name} must be 0 or 1, got {raw[:40]!r}")
    return raw.strip() == "1"


def auto_kv_tokens(config: Mapping | None, blocks: int, itemsize: int) -> int:
    """QUART_KV_MAX_TOKENS=0: the positions whose keys and values for ``blocks`` blocks fit in KV_BUDGET_BYTES."""
    if not config:
        return KV_AUTO_UNKNOWN
    heads = int(config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads)
    per_token = 2 * blocks * int(config.get("num_key_value_heads") or heads) * head_dim * itemsize
    if per_token <= 0:
        return KV_AUTO_MAX
    return max(KV_AUTO_MIN, min(KV_AUTO_MAX, KV_BUDGET_BYTES // per_token))


class Generation:
    """The sessions of one StageRuntime and the step that serves them."""

    def __init__(self, runtime):
        self.rt = runtime
        cfg, manifest = runtime.cfg, runtime.manifest
        if manifest is not None:
            self.decoder = manifest.family == "decoder"
            self.last = runtime.stage_range[1] == runtime.total_layers
            self.vocab = int(manifest.config["vocab_size"])
            blocks = max(0, min(runtime.stage_range[1], runtime.total_layers - 1) - max(runtime.stage_range[0], 1))
            itemsize = torch.empty((), dtype=runtime.shape.dtype).element_size()
            auto = auto_kv_tokens(manifest.config, blocks, itemsize)
        else:  # a parameter-free emulated stage: its profile says whether it decodes
            self.decoder = runtime.step_time is not None
            self.last = cfg.stage_index == runtime.num_stages - 1
            self.vocab = EMULATED_VOCAB
            auto = KV_AUTO_UNKNOWN
        self.table = SessionTable(cfg.kv_max_tokens or auto, cfg.kv_idle_s)
        self.batched = BatchedSteps(self)

    def free(self, session_id: str) -> tuple[int, dict | None]:
        """``DELETE /_/sessions/<id>``: 204, or 404 naming the session this replica does not hold."""
        if self.table.drop(session_id):
            return 204, None
        return 404, {"error": f"this replica holds no session {session_id[:140]!r}", "field": FIELD}

    def headers(self, session_id: str) -> dict[str, str]:
        return {H_SESSION_POS: str(self.table.held(session_id)), H_KV_TOKENS: self.table.occupancy()}

    def check(self, req: SessionRequest, inputs: dict[str, torch.Tensor], span: tuple[int, int] | None) -> int:
        """400 for what a session request cannot carry; the number of new positions."""
        rt = self.rt
        if not self.decoder:
            raise invalid(FIELD, f"model {rt.model!r} is not a decoder: it has no generation sessions")
        if ATTENTION_MASK in inputs:
            raise invalid(ATTENTION_MASK, "a session request carries one unpadded sequence: no attention_mask")
        if SEGMENT_LENGTHS in inputs:
            raise invalid(SEGMENT_LENGTHS, "a session request carries one sequence, not a packed batch")
        first = inputs[INPUT_IDS] if INPUT_IDS in inputs else inputs[HIDDEN]
        if first.shape[0] != 1:
            raise invalid(FIELD, f"a session request carries one sequence (batch 1), got batch {first.shape[0]}")
        new = int(first.shape[1])
        self.check_reach(max(req.pos + new, req.reserve))
        return new

    def new_state(self, seed: int):
        """An empty cache for a session: transformers' ``DynamicCache``, or the emulated stand-in."""
        rt = self.rt
        if rt.cfg.compute != "emulated":
            return rt.module.new_cache()
        cfg = rt.manifest.config if rt.manifest is not None else {}
        heads = int(cfg.get("num_attention_heads") or 1)
        head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size") or 64 * heads) // heads)
        return EmulatedKV(seed, int(cfg.get("num_key_value_heads") or heads) * head_dim, rt.shape.dtype)

    def span_of(self, span: tuple[int, int] | None) -> tuple[int, int] | None:
        """The layers a session request runs: a sub-range (a ParaServe part), or None for the whole stage."""
        return None if span is None or span == self.rt.stage_range else span

    def check_reach(self, positions: int) -> None:
        """400 when a session would reach more positions than the model has."""
        limit = self.rt.shape.max_seq
        if limit is not None and positions > limit:
            raise invalid(FIELD, f"the session would reach {positions} positions; model {self.rt.model!r} has {limit}")

    def step(self, req: SessionRequest, inputs: dict[str, torch.Tensor], new: int, base: dict[str, str],
             timing: tuple[float, float], span: tuple[int, int] | None = None):
        """Run one step of session ``req.id`` and answer it (409/429/500 as JSON, nothing changed)."""
        t0, t1 = timing
        rt = self.rt
        try:
            rt.prepare_device()
            emulated = rt.cfg.compute == "emulated"
            span = self.span_of(span)
            last = self.last if span is None else span[1] == rt.total_layers
            if last:
                req.sample.check_logits(emulated)
            with self.table.step(req.id, req.pos, new, req.reserve, lambda: self.new_state(req.sample.seed), span,
                                 rt.stage_range) as session:
                if emulated:
                    output = self._emulate(session.state, inputs, req, new, span, last)
                else:
                    output = self._compute(session.state, inputs, req, new, span, last)
        except QuartError as exc:
            return StageResponse.error(exc, {**base, **self.headers(req.id), **exc.headers,
                                             H_DESER: elapsed_ms(t0, t1), H_COMPUTE: elapsed_ms(t1)})
        except Exception as exc:  # noqa: BLE001 - a compute failure is answered; the session was freed
            return StageResponse.json(500, {"error": f"stage compute failed: {exc}", "field": "compute"},
                                      {**base, **self.headers(req.id), H_DESER: elapsed_ms(t0, t1), H_COMPUTE: elapsed_ms(t1)})
        t2 = time.perf_counter()
        if req.end:
            self.table.drop(req.id)
        held = req.pos + new
        if span is not None:
            base = {**base, H_LAYERS: fmt(span)}
        if last:
            doc = {**output[0], "pos": held}
            if req.return_logits and output[1] is not None:
                doc["logits"] = output[1].tolist()
            chunks, ctype = [json.dumps(doc).encode()], JSON_TYPE
        else:
            more = span is not None and span[1] < rt.stage_range[1]  # this stage again, for its next part
            chunks = wire.encode_chunks({HIDDEN: output}, rt.next_hop_meta(base[H_REQUEST_ID], more))
            ctype = wire.CONTENT_TYPE
        headers = {**base, H_SESSION_POS: str(held), H_KV_TOKENS: self.table.occupancy(), "Content-Type": ctype,
                   H_DESER: elapsed_ms(t0, t1), H_COMPUTE: elapsed_ms(t1, t2), H_SER: elapsed_ms(t2)}
        return StageResponse(200, chunks, headers)

    def _compute(self, cache, inputs: dict[str, torch.Tensor], req: SessionRequest, new: int,
                 span: tuple[int, int] | None, last: bool):
        rt = self.rt
        if rt._device.type != "cpu":
            inputs = {k: v.to(rt._device, non_blocking=True) for k, v in inputs.items()}
        every = last and len(req.sample.prompt_span(req.pos, new)) > 0  # the head on every position: prompt logprobs
        out = rt.module(inputs, *(span or ()), cache=cache, past=req.pos, every=every)
        if not last:
            return out.cpu() if out.device.type != "cpu" else out
        logits = out[0, -1]
        doc = prompt_answer(out[0], req.sample, req.pos) if every else answer(logits, req.sample, req.pos + new)
        return doc, (logits.float().cpu() if req.return_logits else None)

    def _emulate(self, state: EmulatedKV, inputs: dict[str, torch.Tensor], req: SessionRequest, new: int,
                 span: tuple[int, int] | None, last: bool):
        rt = self.rt
        share = 1.0 if span is None else range_share(rt.manifest.layer_parameter_counts, span, rt.stage_range)
        [ids] = self.emulated_ids(inputs)
        time.sleep(rt.step_time.sample_ms(new, rt._rng) * share / 1000.0)
        self.emulated_append(state, ids, span)
        if last:
            return {"token": state.token(self.vocab)}, None
        return self.emulated_activation([ids], span)

    def emulated_append(self, state: EmulatedKV, ids: list[int], span: tuple[int, int] | None = None) -> None:
        """An emulated step's cache update: the keys and values of ``ids`` in the blocks it ran."""
        ran = span or self.rt.stage_range
        state.append(ids, block_layers(ran, self.rt.total_layers) if ran else range(0))

    @staticmethod
    def emulated_ids(inputs: dict[str, torch.Tensor]) -> list[list[int]]:
        """Each row's token ids: stage 0's input, or the digits an emulated activation carries."""
        if INPUT_IDS in inputs:
            return inputs[INPUT_IDS].tolist()
        digits = inputs[HIDDEN][:, :, :_DIGITS].long()
        return [[sum(int(d) << (8 * k) for k, d in enumerate(pos)) for pos in row] for row in digits.tolist()]

    def emulated_activation(self, ids: list[list[int]], span: tuple[int, int] | None = None) -> torch.Tensor:
        """A zero activation ``[rows, positions, width]`` (of ``span``'s output, default the stage's) carrying each
        position's token id in its first columns."""
        shape = self.rt.shape if span is None else self.rt.shape_for(span)
        out = torch.zeros((len(ids), len(ids[0]), shape.out_width), dtype=self.rt.shape.dtype)
        if shape.out_width >= _DIGITS:
            ids_t = torch.tensor(ids, dtype=torch.long)
            for k in range(_DIGITS):
                out[:, :, k] = ((ids_t >> (8 * k)) & 0xFF).to(out.dtype)
        return out
