"""Tiny configs of every decoder family the stage runtime supports (random weights via quart_tools.partition):
sliding windows of 4, shorter than most test sequences."""

from __future__ import annotations

TINY_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=128,
                 max_position_embeddings=64)
DECODER_CONFIGS = {
    "llama": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True, **TINY_BASE),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=4, **TINY_BASE),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                  max_window_layers=2, **TINY_BASE),
    "opt": dict(model_type="opt", ffn_dim=64, word_embed_proj_dim=32,
                **{k: v for k, v in TINY_BASE.items() if k != "intermediate_size"}),
}
