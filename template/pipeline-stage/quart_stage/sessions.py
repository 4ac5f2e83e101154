"""Generation sessions on a stage replica: prefill once, then one-position decode steps (docs/generation.md).

A request with ``X-Quart-Session`` carries only a session's new positions. The stage appends them to the
session's KV cache for its own layers (:mod:`quart_stage.kvcache`), runs its layers over them, and answers
their ``hidden_states`` for the next stage; the last stage answers one sampled token as JSON
(:mod:`quart_stage.sampling`). Emulated compute keeps the same bookkeeping, sleeps a prefill or decode
time (:class:`quart_stage.emulated.StepTime`) and answers tokens that are a hash of the session's ids.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from quart_stage import wire
from quart_stage.errors import QuartError, invalid
from quart_stage.inputs import ATTENTION_MASK, HIDDEN, INPUT_IDS
from quart_stage.kvcache import (
    FIELD,
    H_KV_TOKENS,
    H_SESSION,
    H_SESSION_END,
    H_SESSION_POS,
    H_SESSION_RESERVE,
    SessionTable,
)
from quart_stage.layers import range_share
from quart_stage.response import H_COMPUTE, H_DESER, H_REQUEST_ID, H_SER, JSON_TYPE, StageResponse, elapsed_ms
from quart_stage.sampling import H_SAMPLE, SampleParams, choose, parse_sample
from quart_stage.spans import H_LAYERS, fmt

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
        id=sid, pos=_count(headers.get(H_SESSION_POS.lower()), H_SESSION_POS, required=True),
        reserve=_count(headers.get(H_SESSION_RESERVE.lower()), H_SESSION_RESERVE),
        end=_flag(headers.get(H_SESSION_END.lower()), H_SESSION_END),
        sample=parse_sample(headers.get(H_SAMPLE.lower())),
        return_logits=_flag(headers.get(H_RETURN_LOGITS.lower()), H_RETURN_LOGITS))


def _count(raw: str | None, name: str, required: bool = False) -> int:
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


class EmulatedState:
    """An emulated session's stand-in for a KV cache: a running hash of the session's token ids."""

    def __init__(self, seed: int):
        self.digest = hashlib.blake2b(f"{seed}:".encode(), digest_size=8)

    def token(self, ids: list[int], vocab: int) -> int:
        self.digest.update(b"".join(i.to_bytes(8, "big") for i in ids))
        return int.from_bytes(self.digest.copy().digest(), "big") % vocab


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
        first = inputs[INPUT_IDS] if INPUT_IDS in inputs else inputs[HIDDEN]
        if first.shape[0] != 1:
            raise invalid(FIELD, f"a session request carries one sequence (batch 1), got batch {first.shape[0]}")
        new = int(first.shape[1])
        limit = rt.shape.max_seq
        if limit is not None and max(req.pos + new, req.reserve) > limit:
            raise invalid(FIELD, f"the session would reach {max(req.pos + new, req.reserve)} positions; "
                                 f"model {rt.model!r} has {limit}")
        return new

    def part(self, span: tuple[int, int] | None) -> tuple[int, int] | None:
        """The layers of a session request: None for the whole stage, else the part ``X-Quart-Layers`` names
        (cooperative execution: this replica keeps the session's KV cache for those layers only)."""
        return None if span is None or span == self.rt.stage_range else span

    def step(self, req: SessionRequest, inputs: dict[str, torch.Tensor], new: int, base: dict[str, str],
             timing: tuple[float, float], span: tuple[int, int] | None = None):
        """Run one step of session ``req.id`` over layers ``span`` (None: the whole stage) and answer it
        (409/429/500 as JSON, nothing changed). A session keeps the layers of its first step: a later step
        for other layers gets 409 (the gateway replays)."""
        t0, t1 = timing
        rt = self.rt
        part = self.part(span)
        last = self.last if part is None else part[1] == rt.total_layers
        try:
            rt.prepare_device()
            emulated = rt.cfg.compute == "emulated"
            make = (lambda: EmulatedState(req.sample.seed)) if emulated else rt.module.new_cache
            with self.table.step(req.id, req.pos, new, req.reserve, make, part, rt.stage_range) as session:
                if emulated:
                    output = self._emulate(session.state, inputs, req, new, part, last)
                else:
                    output = self._compute(session.state, inputs, req, new, part, last)
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
        if last:
            doc = {"token": output[0], "pos": held}
            if req.return_logits and output[1] is not None:
                doc["logits"] = output[1].tolist()
            chunks, ctype = [json.dumps(doc).encode()], JSON_TYPE
        else:
            more = part is not None and part[1] < rt.stage_range[1]  # the rest of this stage runs elsewhere
            chunks = wire.encode_chunks({HIDDEN: output}, rt.next_hop_meta(base[H_REQUEST_ID], more))
            ctype = wire.CONTENT_TYPE
        if part is not None:
            base = {**base, H_LAYERS: fmt(part)}
        headers = {**base, H_SESSION_POS: str(held), H_KV_TOKENS: self.table.occupancy(), "Content-Type": ctype,
                   H_DESER: elapsed_ms(t0, t1), H_COMPUTE: elapsed_ms(t1, t2), H_SER: elapsed_ms(t2)}
        return StageResponse(200, chunks, headers)

    def _compute(self, cache, inputs: dict[str, torch.Tensor], req: SessionRequest, new: int,
                 part: tuple[int, int] | None, last: bool):
        rt = self.rt
        if rt._device.type != "cpu":
            inputs = {k: v.to(rt._device, non_blocking=True) for k, v in inputs.items()}
        out = rt.module(inputs, *(part or ()), cache=cache, past=req.pos)
        if not last:
            return out.cpu() if out.device.type != "cpu" else out
        logits = out[0, -1]
        token = choose(logits, req.sample, req.pos + new)
        return token, (logits.float().cpu() if req.return_logits else None)

    def _emulate(self, state: EmulatedState, inputs: dict[str, torch.Tensor], req: SessionRequest, new: int,
                 part: tuple[int, int] | None, last: bool):
        rt = self.rt
        if INPUT_IDS in inputs:
            ids = inputs[INPUT_IDS][0].tolist()
        else:
            digits = inputs[HIDDEN][0, :, :_DIGITS].long()
            ids = [sum(int(d) << (8 * k) for k, d in enumerate(row)) for row in digits.tolist()]
        share = 1.0 if part is None else range_share(rt.manifest.layer_parameter_counts, part, rt.stage_range)
        time.sleep(rt.step_time.sample_ms(new, rt._rng) * share / 1000.0)
        if last:
            return state.token(ids, self.vocab), None
        shape = rt.shape if part is None else rt.shape_for(part)
        out = torch.zeros((1, new, shape.out_width), dtype=shape.dtype)
        if shape.out_width >= _DIGITS:
            ids_t = torch.tensor(ids, dtype=torch.long)
            for k in range(_DIGITS):
                out[0, :, k] = ((ids_t >> (8 * k)) & 0xFF).to(out.dtype)
        return out
