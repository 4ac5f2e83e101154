"""Test helper: stage replicas that speak the session protocol of docs/generation.md with a toy model.

Each replica keeps, per session, the ids it has seen (its "KV cache"); a stage passes the ids on as JSON
(``{"h": [...]}``, standing in for hidden states); the last stage answers the next token, chosen by the real
sampler (quart_stage.sampling, ``X-Quart-Sample``) from toy logits whose maximum is a pure function of the
whole sequence (:func:`next_token`: greedy gives it), so a replay gives the same tokens as an uninterrupted run.
It answers 409 for a wrong ``X-Quart-Session-Pos``, 429 over its KV cap, frees on ``X-Quart-Session-End``
and ``DELETE /_/sessions/<id>``, and records what it was asked.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import torch
from aiohttp import web
from quart_stage import sampling

VOCAB = 256
EOS = 2


def next_token(sequence: list[int], eos_after: int | None = None, prompt_len: int = 0) -> int:
    """The toy model: the next token of ``sequence`` (EOS once ``eos_after`` tokens were generated)."""
    if eos_after is not None and len(sequence) - prompt_len >= eos_after:
        return EOS
    return (sum(sequence) * 7 + len(sequence) * 13) % (VOCAB - 40) + 32  # printable bytes, never EOS


def toy_logits(sequence: list[int], eos_after: int | None = None, prompt_len: int = 0) -> torch.Tensor:
    """The toy model's logits: small seeded noise and a clear maximum at :func:`next_token` (greedy = the toy)."""
    noise = torch.randn(VOCAB, generator=torch.Generator().manual_seed(sum(sequence) * 31 + len(sequence)))
    logits = (noise * 1.2).clamp(max=3.0)  # a penalty of 2 on the maximum lets another token win
    logits[next_token(sequence, eos_after, prompt_len)] = 4.0
    return logits


def reference(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


@dataclass
class FakeStage:
    index: int
    last: bool
    cap: int = 4096
    eos_after: int | None = None
    sessions: dict[str, list[int]] = field(default_factory=dict)
    prompts: dict[str, int] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    calls: int = 0
    fail_next: int = 0  # answer this many calls with 500
    delay_s: float = 0.0  # each call takes this long (a slow stage)
    samples: list = field(default_factory=list)  # the last stage's sampling parameters, one per step

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/", self.invoke)
        app.router.add_delete("/_/sessions/{sid}", self.delete)
        app.router.add_get("/_/sessions", self.listing)
        return app

    def used(self) -> int:
        return sum(len(v) for v in self.sessions.values())

    async def invoke(self, request: web.Request) -> web.Response:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_next:
            self.fail_next -= 1
            return web.json_response({"error": "injected"}, status=500)
        sid = request.headers["X-Quart-Session"]
        pos = int(request.headers["X-Quart-Session-Pos"])
        held = self.sessions.get(sid, [])
        if pos != len(held) or (pos == 0 and sid in self.sessions):
            return web.json_response({"error": "position", "field": "session", "held": len(held)}, status=409)
        doc = json.loads(await request.read())
        new = doc["input_ids"][0] if self.index == 0 else doc["h"]
        if self.used() + len(new) > self.cap:
            return web.json_response({"error": "full", "field": "kv_cache"}, status=429, headers={"Retry-After": "1"})
        if pos == 0:
            self.prompts[sid] = len(new)
        seq = self.sessions[sid] = held + list(new)
        headers = {"X-Quart-Session-Pos": str(len(seq)), "X-Quart-KV-Tokens": f"{self.used()}/{self.cap}"}
        if request.headers.get("X-Quart-Session-End"):
            self.ended.append(sid)
            del self.sessions[sid]
        if not self.last:
            return web.json_response({"h": new}, headers=headers)
        assert json.loads(request.headers["X-Quart-Sample"])["seed"] is not None
        sample = sampling.parse_sample(request.headers["X-Quart-Sample"])  # the real sampler on toy logits
        self.samples.append(sample)
        rows = torch.stack([toy_logits(seq[:q + 1], self.eos_after, self.prompts.get(sid, 0))
                            for q in range(pos, len(seq))])  # each new position's logits: the next token's
        doc = sampling.prompt_answer(rows, sample, pos)
        return web.json_response({**doc, "pos": len(seq)}, headers=headers)

    async def delete(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        self.deleted.append(sid)
        if self.sessions.pop(sid, None) is None:
            return web.json_response({"error": "unknown"}, status=404)
        return web.Response(status=204)

    async def listing(self, request: web.Request) -> web.Response:
        return web.json_response({"sessions": [{"id": k, "tokens": len(v), "idle_s": 0} for k, v in
                                               self.sessions.items()], "kv_tokens": self.used(), "kv_tokens_max": self.cap})
