"""One decode step for several sessions at once: their caches side by side, of different lengths.

A batched decode step stacks one new position per session into a ``[sessions, 1, hidden]`` batch, so every
projection, MLP and the head run as one matrix product over the batch. Attention is the only part that needs
each session's own past: :class:`RaggedCache` is the ``past_key_values`` of the step; when a block appends its
keys and values, each session's row goes into that session's own ``DynamicCache`` and the block gets back
:class:`Ragged` keys and values (one tensor per session, each as long as that session). The attention
function registered as :data:`RAGGED_ATTENTION` (the stage module's ``_attn_implementation``) runs transformers'
own SDPA attention per session on those, exactly the call an unbatched step makes, and SDPA as before on plain
tensors (one-shot passes, prefill). A one-position step needs no mask (nothing after it to hide).
Padded batched caches (one ``[sessions, heads, longest, dim]`` tensor and a mask, every session's cache copied
into it each step) measured within the noise of this at 16 sessions (docs/batching.md); ragged copies nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

RAGGED_ATTENTION = "quart_ragged"


@dataclass(frozen=True)
class Ragged:
    """Per-session tensors of one layer (``[1, heads, length_i, dim]`` each) standing in for a batched one."""

    parts: tuple[torch.Tensor, ...]


class RaggedCache:
    """The ``past_key_values`` of a batched decode step: row ``i`` of the batch belongs to ``caches[i]``."""

    is_compileable = False

    def __init__(self, caches: Sequence) -> None:
        self.caches = list(caches)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs=None) -> tuple[Ragged, Ragged]:
        keys, values = [], []
        for row, cache in enumerate(self.caches):
            k, v = cache.update(key[row : row + 1], value[row : row + 1], layer_idx, cache_kwargs)
            keys.append(k)
            values.append(v)
        return Ragged(tuple(keys)), Ragged(tuple(values))


def ragged_attention(module, query: torch.Tensor, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, per session when the keys are :class:`Ragged` (one query position each)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(key, Ragged):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = [sdpa_attention_forward(module, query[row : row + 1], k, v, None, **kwargs)[0]
            for row, (k, v) in enumerate(zip(key.parts, value.parts, strict=True))]
    return torch.cat(outs, dim=0), None


_registered = False


def register() -> str:
    """Register the ragged attention (and SDPA's masks under its name) with transformers; its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
        AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
        _registered = True
    return RAGGED_ATTENTION
