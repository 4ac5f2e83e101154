"""One batched decode step on in-process stages: ragged per-session caches vs padded caches vs transformers.

Part of `quartctl bench batching --part decode` (``--stage-step``; docs/batching.md#decode-continuous-batching).
SmolLM2-135M (real weights) cut into 3 stages in this process, one torch thread; ``B`` sessions with prompts of
``context + 3 i`` tokens (different lengths) prefilled, then the median wall time of ``--step-rounds`` decode rounds
through every stage's ``StageRuntime.handle`` (the wire between stages included), the four modes interleaved
round by round:

- ``unbatched_ms``: the ``B`` sessions' steps one after another (one call per session and stage);
- ``ragged_ms``: one batched step (quart_stage.ragged: batched projections, attention per session on its own cache);
- ``padded_ms``: the same batched step with every session's keys and values copied into one padded
  ``[B, heads, longest, dim]`` tensor and a mask, one SDPA call per layer (the alternative design, measured here);
- ``transformers_ms``: the whole model's own batched decode step (a left-padded batch, its ``DynamicCache``, an
  attention mask), ``model(input_ids=[B, 1], ...)``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch


def padded_attention(module, query, key, value, attention_mask, **kwargs):
    """The padded alternative: per-session keys/values copied into one padded tensor, one masked SDPA call."""
    from quart_stage.ragged import Ragged
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(key, Ragged):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    first = key.parts[0]
    longest = max(k.shape[2] for k in key.parts)
    keys = first.new_zeros((len(key.parts), first.shape[1], longest, first.shape[3]))
    values = torch.zeros_like(keys)
    mask = torch.zeros((len(key.parts), 1, 1, longest), dtype=torch.bool)
    for row, (k, v) in enumerate(zip(key.parts, value.parts, strict=True)):
        keys[row, :, : k.shape[2]] = k[0]
        values[row, :, : v.shape[2]] = v[0]
        mask[row, ..., : k.shape[2]] = True
    return sdpa_attention_forward(module, query, keys, values, mask, **kwargs)


def stage_step_rows(model_dir: Path, context: int, rounds: int, sizes=(1, 4, 16)) -> list[dict]:
    from quart_stage import ragged
    from quart_stage.verify import reference_model
    from quart_tools.partition import split_layers
    from quart_tools.stagechain import batched_step, cut_runtimes, session_step, whole_tensors
    from transformers import AttentionInterface

    torch.set_num_threads(1)
    manifest, tensors = whole_tensors(str(model_dir))
    runtimes = cut_runtimes(str(model_dir), manifest, tensors, split_layers(manifest.layer_parameter_counts, 3,
                                                                              manifest.method))
    model = reference_model(str(model_dir))
    gen = torch.Generator().manual_seed(1)
    vocab = int(manifest.config["vocab_size"])

    def prefill(count: int, tag: str) -> dict[str, tuple[int, int]]:
        held = {}
        for i in range(count):
            prompt = torch.randint(0, vocab, (context + 3 * i,), generator=gen).tolist()
            doc = json.loads(session_step(runtimes, prompt, 0, f"{tag}{i}").body)
            held[f"{tag}{i}"] = (doc["token"], doc["pos"])
        return held

    def one_by_one(held):
        for sid, (tok, pos) in list(held.items()):
            doc = json.loads(session_step(runtimes, [tok], pos, sid).body)
            held[sid] = (doc["token"], doc["pos"])

    def together(held):
        steps = [(sid, tok, pos) for sid, (tok, pos) in held.items()]
        for (sid, _, _), doc in zip(steps, batched_step(runtimes, steps), strict=True):
            held[sid] = (doc["token"], doc["pos"])

    rows = []
    for count in sizes:  # the four modes interleaved round by round: a loaded machine's drift hits them alike
        alone, held = prefill(count, f"u{count}-"), {m: prefill(count, f"{m}{count}-") for m in ("ragged", "padded")}
        times: dict[str, list[float]] = {"unbatched": [], "ragged": [], "padded": [], "transformers": []}
        whole = _transformers_state(model, count, context, vocab, gen)
        for _ in range(rounds):
            times["unbatched"].append(_timed(lambda a=alone: one_by_one(a)))
            for name, attention in (("ragged", ragged.ragged_attention), ("padded", padded_attention)):
                AttentionInterface.register(ragged.RAGGED_ATTENTION, attention)
                try:
                    times[name].append(_timed(lambda h=held[name]: together(h)))
                finally:
                    AttentionInterface.register(ragged.RAGGED_ATTENTION, ragged.ragged_attention)
            times["transformers"].append(_timed(whole))
        rows.append({"sessions": count, **{f"{k}_ms": round(1000 * statistics.median(v), 2) for k, v in times.items()}})
    return rows


def _timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def _transformers_state(model, count: int, context: int, vocab: int, gen: torch.Generator):
    """The whole model prefilled with ``count`` left-padded prompts; a function that runs its next decode step."""
    lengths = [context + 3 * i for i in range(count)]
    longest = max(lengths)
    ids = torch.zeros((count, longest), dtype=torch.long)
    mask = torch.zeros((count, longest), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, longest - n:] = torch.randint(0, vocab, (n,), generator=gen)
        mask[i, longest - n:] = 1
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    state = {"cache": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True), "mask": mask}

    @torch.inference_mode()
    def step():
        state["mask"] = torch.cat([state["mask"], torch.ones((count, 1), dtype=torch.long)], 1)
        positions = state["mask"].sum(1, keepdim=True) - 1
        out = model(input_ids=state["next"], attention_mask=state["mask"], past_key_values=state["cache"],
                    position_ids=positions, use_cache=True)
        state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)

    return step
