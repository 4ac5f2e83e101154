"""A partition's stages driven in one process through `StageRuntime.handle`, as the gateway drives them over HTTP:
generation sessions (prefill, then one-position decode steps, the protocol of docs/generation.md) and the
runtimes of any cut of a model's in-memory tensors. Used by the tests and `quartctl bench stage-generation`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from quart_stage import families, wire
from quart_stage.config import StageConfig
from quart_stage.manifest import Manifest, StageEntry
from quart_stage.runtime import StageResponse, StageRuntime
from quart_stage.sample_history import with_history


@dataclass
class Generated:
    """A session's answer: the new tokens, each step's wall time (s; step 0 is the prefill) and, when asked,
    each token's logits."""

    tokens: list[int]
    step_s: list[float]
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.step_s[0]

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        rest = self.step_s[1:]
        return sum(rest) / len(rest) if rest else 0.0


def whole_tensors(model_dir: str) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The manifest of a partitioned model and every stage's tensors, in memory (for :func:`cut_runtimes`)."""
    from quart_stage.runtime import read_stage_file

    manifest = Manifest.load(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for entry in manifest.stages:
        tensors.update(read_stage_file(model_dir, entry))
    return manifest, tensors


def cut_runtimes(model_dir: str, manifest: Manifest, tensors: Mapping[str, torch.Tensor], bounds: Sequence[int],
                 **settings) -> list[StageRuntime]:
    """The runtimes of the cut ``bounds`` (layer-list boundaries, e.g. ``[0, 11, 22, 32]``) of the model partitioned
    in ``model_dir`` whose tensors are all in memory; parameters attached by reference. ``settings``: more
    StageConfig fields."""
    cfg = families.make_config(manifest.config)
    plan, blocks = families.plan_for(cfg), families.num_blocks(cfg)
    entries = [StageEntry(i, a, b, manifest.layers[a:b], None, 0, 0, None)
               for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
    cut = replace(manifest, stages=entries)
    out = []
    for e in entries:
        own = {k: v for k, v in tensors.items() if e.start <= plan.layer_of(k, blocks) < e.end}
        out.append(StageRuntime.from_tensors(StageConfig(model_dir=model_dir, stage_index=e.index, **settings), cut, own))
    return out


def session_step(runtimes: Sequence[StageRuntime], ids: Sequence[int], pos: int, session: str, *,
                 sample: Mapping | None = None, logits: bool = False, reserve: int = 0,
                 end: bool = False) -> StageResponse:
    """One step of ``session`` (new token ``ids`` after ``pos`` held positions) through every stage; the last
    stage's response, or the first one that is not 200."""
    headers = {"X-Quart-Session": session, "X-Quart-Session-Pos": str(pos)}
    if sample:
        headers["X-Quart-Sample"] = json.dumps(dict(sample))
    if logits:
        headers["X-Quart-Return-Logits"] = "1"
    if reserve:
        headers["X-Quart-Session-Reserve"] = str(reserve)
    if end:
        headers["X-Quart-Session-End"] = "1"
    body, ctype = json.dumps({"input_ids": [list(ids)]}).encode(), "application/json"
    for rt in runtimes:
        resp = rt.handle(body, {**headers, "Content-Type": ctype})
        if resp.status != 200:
            return resp
        body, ctype = resp.body, wire.CONTENT_TYPE
    return resp


def generate(runtimes: Sequence[StageRuntime], prompt: Sequence[int], new_tokens: int, *, session: str = "s",
             sample: Mapping | None = None, chunk: int | None = None, logits: bool = False,
             reserve: bool = True) -> Generated:
    """``new_tokens`` tokens after ``prompt``: prefill (in chunks of ``chunk`` positions when given), then decode
    steps of one position; the session's cache is freed with its last step. Raises on a non-200 answer."""
    out = Generated([], [])
    pos, pending = 0, list(prompt)
    total = len(prompt) + new_tokens - 1
    t0 = time.perf_counter()
    while len(out.tokens) < new_tokens:
        step = pending if chunk is None else pending[:chunk]
        pending = pending[len(step):]
        last = not pending and len(out.tokens) == new_tokens - 1
        resp = session_step(runtimes, step, pos, session, logits=logits,
                            sample=sample and with_history(dict(sample), list(prompt), out.tokens),
                            reserve=total if reserve and pos == 0 else 0, end=last)
        if resp.status != 200:
            raise RuntimeError(f"session step at position {pos}: {resp.status} {resp.body[:300]!r}")
        pos += len(step)
        if pending:  # a prefill chunk: the stages answered, the token is not the next one yet
            continue
        doc = json.loads(resp.body)
        assert doc["pos"] == pos, (doc, pos)
        out.tokens.append(doc["token"])
        out.step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if logits:
            out.logits.append(torch.tensor(doc["logits"]))
        pending = [doc["token"]]
    return out


def batched_step(runtimes: Sequence[StageRuntime], steps: Sequence[tuple[str, int, int]], *,
                 samples: Mapping[str, Mapping] | None = None, ends: Sequence[str] = ()) -> list[dict]:
    """One batched decode step (quart_stage.batchwire) of the sessions ``steps`` = ``(session, token, pos)``
    through every stage, as the gateway sends it: each stage's answer carries the sessions that succeeded on.
    Each session's result (``status``, and ``token`` / ``pos`` or ``error`` / ``field``), in order."""
    from quart_stage import batchwire

    samples = samples or {}
    entries = [batchwire.BatchEntry(sid, pos, sid in ends) for sid, _, pos in steps]
    results: dict[str, dict] = {}
    tensor = {"input_ids": torch.tensor([[tok] for _, tok, _ in steps], dtype=torch.int64)}
    for k, rt in enumerate(runtimes):
        if not entries:
            break
        last = k == len(runtimes) - 1
        table = [replace(e, sample=samples.get(e.id, {})) if last else e for e in entries]  # histories: the caller's
        body = wire.encode_bytes(tensor, {batchwire.META_SESSIONS: json.dumps([e.doc() for e in table])})
        resp = rt.handle(body, {batchwire.H_SESSION_BATCH: str(len(table)), "Content-Type": wire.CONTENT_TYPE})
        if resp.status != 200:
            raise RuntimeError(f"batched step at stage {k}: {resp.status} {resp.body[:300]!r}")
        if last:
            answers = json.loads(resp.body)[batchwire.META_RESULTS]
        else:
            decoded = wire.decode(resp.body)
            answers = json.loads(decoded.metadata[batchwire.META_RESULTS])
            tensor = {"hidden_states": decoded.tensors["hidden_states"].clone()}
        results.update({a["id"]: a for a in answers if a["status"] != 200 or last})
        entries = [e for e, a in zip(entries, answers, strict=True) if a["status"] == 200]
    return [results[sid] for sid, _, _ in steps]


def generate_batched(runtimes: Sequence[StageRuntime], prompts: Sequence[Sequence[int]], new_tokens: Sequence[int],
                     *, prefix: str = "b", samples: Sequence[Mapping | None] | None = None) -> list[list[int]]:
    """Several sessions at once: each prompt prefilled alone, then every decode step of the sessions still
    running as one batched step (a session leaves the batch after its ``new_tokens``). Each session's tokens."""
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    sample_of = {sid: dict(s) for sid, s in zip(ids, samples or [None] * len(ids), strict=True) if s}
    tokens: dict[str, list[int]] = {}
    held: dict[str, int] = {}
    for sid, prompt, n in zip(ids, prompts, new_tokens, strict=True):
        sample = sample_of.get(sid)
        resp = session_step(runtimes, prompt, 0, sid, sample=sample and with_history(sample, list(prompt), []),
                            reserve=len(prompt) + n, end=n == 1)
        if resp.status != 200:
            raise RuntimeError(f"prefill of {sid}: {resp.status} {resp.body[:300]!r}")
        doc = json.loads(resp.body)
        tokens[sid], held[sid] = [doc["token"]], doc["pos"]
    want = dict(zip(ids, new_tokens, strict=True))
    while running := [sid for sid in ids if len(tokens[sid]) < want[sid]]:
        steps = [(sid, tokens[sid][-1], held[sid]) for sid in running]
        ends = [sid for sid in running if len(tokens[sid]) + 1 == want[sid]]
        now = {sid: with_history(s, list(prompts[ids.index(sid)]), tokens[sid]) for sid, s in sample_of.items()}
        for (sid, _, _), doc in zip(steps, batched_step(runtimes, steps, samples=now, ends=ends), strict=True):
            if doc["status"] != 200:
                raise RuntimeError(f"batched step of {sid}: {doc}")
            tokens[sid].append(doc["token"])
            held[sid] = doc["pos"]
    return [tokens[sid] for sid in ids]
