"""Model presets (architecture configs built with random weights) and the QUART paper's model profiles.

- `tiny-*`  : a few MB; what the tests use.
- `small-*` : about 200 MB; the demo model. Its sizes are chosen so that the 16-entry layer list
  (embeddings, 14 blocks, head) splits evenly into 2, 4 and 8 stages: the embedding and the head hold
  about as many parameters as one block.
- paper models (Table 1 of the QUART paper): `bert-21b`, `llama-7b`, `opt-66b` as architecture configs
  (never instantiated in CI; partitioned with `--weights none` they give a manifest for emulated runs),
  `whisper-9b` and `wideresnet` as emulated profiles only (no transformers architecture).
"""

from __future__ import annotations

from dataclasses import dataclass

# Architecture configs: keyword arguments of transformers.AutoConfig.for_model(model_type, ...).
_TINY_DECODER = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_TINY_ENCODER = dict(
    model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False,
)
_SMALL_DECODER = dict(
    model_type="llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=14, num_attention_heads=8,
    num_key_value_heads=8, vocab_size=6144, max_position_embeddings=1024, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_SMALL_ENCODER = dict(
    model_type="bert", hidden_size=512, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=8,
    vocab_size=6144, max_position_embeddings=512, tie_word_embeddings=False,
)
# Paper models. BERT-21B is not a published checkpoint: 46 layers of width 6144 give 21.2 B parameters
# (42.4 GB in fp16, Table 1 says 43 GB). LLaMA-7B and OPT-66B are the published architectures.
_BERT_21B = dict(
    model_type="bert", hidden_size=6144, intermediate_size=24576, num_hidden_layers=46, num_attention_heads=48,
    vocab_size=30522, max_position_embeddings=512, tie_word_embeddings=False,
)
_LLAMA_7B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_OPT_66B = dict(
    model_type="opt", hidden_size=9216, ffn_dim=36864, num_hidden_layers=64, num_attention_heads=72,
    vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=9216, do_layer_norm_before=True,
    tie_word_embeddings=True,
)

MODEL_PRESETS: dict[str, dict] = {
    "tiny-decoder": _TINY_DECODER,
    "tiny-encoder": _TINY_ENCODER,
    "small-decoder": _SMALL_DECODER,
    "small-encoder": _SMALL_ENCODER,
    "bert-21b": _BERT_21B,
    "llama-7b": _LLAMA_7B,
    "opt-66b": _OPT_66B,
}
PRESET_ALIASES = {"tiny": "tiny-decoder", "small": "small-decoder"}
PRESET_DTYPES = {"bert-21b": "float16", "llama-7b": "float16", "opt-66b": "float16"}
"""Paper models are served in fp16 (Table 1 sizes are fp16); the small presets are fp32."""


@dataclass(frozen=True)
class PaperProfile:
    """One row of the QUART paper's Table 1, plus the activation shape an emulated stage moves.

    exec_ms is the standalone GPU inference time of the whole model; an emulated stage's mean service
    time is its share of it (by parameter bytes when a manifest is present, else 1/N).
    """

    name: str
    size_gb: float
    operators: int
    tokens: int | None
    exec_ms: float
    hidden: int
    seq: int
    dtype: str = "float16"
    preset: str | None = None
    decode_ms: float | None = None
    """Decoders: one generated token of the whole model at batch 1 (emulated generation). Decoding is bound by
    reading the weights: fp16 bytes / ~1.5 TB/s of A100 HBM, rounded up (LLaMA-7B 14 GB -> 12 ms; OPT-66B
    132 GB -> 90 ms)."""

    def activation_shape(self, batch: int = 1) -> tuple[int, int, int]:
        return (batch, self.seq, self.hidden)


PAPER_PROFILES: dict[str, PaperProfile] = {
    # Whisper: 1500 encoder frames of width 1280; WideResNet: a 14x14x2048 feature map as 196 x 2048.
    "whisper-9b": PaperProfile("whisper-9b", 2.9, 677, None, 74.0, hidden=1280, seq=1500),
    "bert-21b": PaperProfile("bert-21b", 43, 1195, 128, 137.0, hidden=6144, seq=128, preset="bert-21b"),
    "llama-7b": PaperProfile("llama-7b", 14, 225, 1024, 243.0, hidden=4096, seq=1024, preset="llama-7b",
                             decode_ms=12.0),
    "opt-66b": PaperProfile("opt-66b", 132, 581, 128, 278.0, hidden=9216, seq=128, preset="opt-66b",
                            decode_ms=90.0),
    "wideresnet": PaperProfile("wideresnet", 16, 295, None, 646.0, hidden=2048, seq=196),
}


def resolve_preset(name: str) -> str | None:
    """The canonical preset name for `name` (aliases resolved), or None if it is not a preset."""
    name = PRESET_ALIASES.get(name, name)
    return name if name in MODEL_PRESETS else None


def preset_config(name: str) -> dict:
    """A copy of a preset's architecture config (raises KeyError naming the known presets)."""
    canonical = resolve_preset(name)
    if canonical is None:
        known = ", ".join([*MODEL_PRESETS, *PRESET_ALIASES])
        raise KeyError(f"unknown model preset {name!r}; known presets: {known}")
    return dict(MODEL_PRESETS[canonical])


def paper_profile(name: str) -> PaperProfile:
    try:
        return PAPER_PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known profiles: {', '.join(PAPER_PROFILES)}") from None
