"""A tiny random llama for generation-session tests (six blocks: one stage of layers [0, 8), embeddings to head)
and transformers' greedy ``generate`` of its prompts, the tokens the sessions must give."""

from __future__ import annotations

import torch

CONFIG = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=96, tie_word_embeddings=True)
STAGE = (0, 8)  # embeddings, 6 blocks, head


def prompts(*lengths: int) -> list[list[int]]:
    """One prompt of each length, seeded by it."""
    return [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def tiny_llama(folder: str, name: str, seed: int, prompt_list: list[list[int]], new: int) -> list[list[int]]:
    """Write the model (one stage) into ``folder``; the greedy tokens of each prompt (non-degenerate, checked)."""
    from quart_stage.verify import reference_model
    from quart_tools.partition import partition

    partition({**CONFIG, "_name": name}, 1, folder, progress=False, seed=seed, std=0.5)
    ref = reference_model(folder)
    with torch.inference_mode():
        tokens = [ref.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, use_cache=True,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompt_list]
    assert all(len(set(t)) >= 3 for t in tokens), "the random weights must give non-degenerate sequences"
    return tokens


def greedy(whole, ids: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` of ``n`` tokens after ``ids`` on ``whole`` (a ``reference_model``), EOS
    ignored: the tokens a pipeline's generation must give."""
    whole.generation_config.eos_token_id = None
    whole.generation_config.pad_token_id = 0
    with torch.inference_mode():
        out = whole.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, use_cache=True)
    return out[0, len(ids):].tolist()
