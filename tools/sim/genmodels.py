"""Decoder pipelines for the simulator's generation workloads: stage step times, KV capacity, SLOs, load.

One source with the live emulated stage: a stage's decode and prefill-per-token times are
`quart_stage.emulated.step_time_for` of the paper profile (`quart_stage.presets.PAPER_PROFILES`: LLaMA-7B
12 ms per token for the whole model, OPT-66B 90 ms; prefill = Table 1's time / its sequence length), split
evenly over the stages. KV bytes per position come from the model's published architecture
(`quart_stage.presets.MODEL_PRESETS`, fp16 K and V of the stage's layers); a replica's KV capacity is what
its GPU holds beside the stage's parameters. SLOs follow ParaServe §8.1's rule: TTFT = 5 × a warm request's
(1,024 prompt tokens), TPOT = 2 × a warm request's (a decode batch of 8 such sessions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from quart_stage.emulated import step_time_for
from quart_stage.presets import MODEL_PRESETS, PAPER_PROFILES
from quart_tools.sim.calibration import PAPER_STAGES, activation_bytes
from quart_tools.sim.state import StageSpec

GEN_MODELS = ("llama-7b", "opt-66b")
GPU_MEMORY_BYTES = 48e9  # assumption: the QUART paper's cluster ran A40s (48 GB) in its §3 experiments
KV_MEMORY_SHARE = 0.9  # of the GPU memory left beside the stage's parameters (activations, workspace: the rest)
WARM_PROMPT_TOKENS, WARM_BATCH = 1024, 8  # ParaServe §8.1: warm requests of 1,024 input tokens, batch 8
TTFT_SLO_X, TPOT_SLO_X = 5.0, 2.0  # ParaServe §8.1: TTFT SLO = 5 × warm TTFT, TPOT SLO = 2 × warm TPOT
MAX_CONTEXT, MAX_NEW_TOKENS = 2048, 256  # `quartctl load --generate`'s caps (LLaMA-7B and OPT-66B hold 2,048)


@dataclass(frozen=True)
class DecoderModel:
    """A decoder split into stages, with the numbers the generation data plane and the report need."""

    name: str
    stages: tuple[StageSpec, ...]
    ttft_slo_s: float
    tpot_slo_s: float


def kv_bytes_per_token(model: str) -> float:
    """fp16 K and V of one position over every layer of ``model``'s published architecture."""
    arch = MODEL_PRESETS[model]
    heads = arch["num_attention_heads"]
    kv_heads = arch.get("num_key_value_heads", heads)
    return 2.0 * arch["num_hidden_layers"] * kv_heads * (arch["hidden_size"] / heads) * 2


def work_per_session_s(spec: StageSpec, prompt: np.ndarray, new: np.ndarray) -> np.ndarray:
    """One stage's busy seconds per session: its prefill step, then one decode step per later token."""
    return np.maximum(spec.decode_s, prompt * spec.prefill_s_per_token) + (new - 1) * spec.decode_s


def decoder_model(model: str, prompt: np.ndarray, new: np.ndarray, stages: int = PAPER_STAGES,
                  hop_s: float = 0.001, gpu_memory_bytes: float = GPU_MEMORY_BYTES, prefill_chunk: int = 128,
                  hbm_bytes_s: float = 1.5e12) -> DecoderModel:
    """``model`` over ``stages`` even stages; ``service_s`` (what the controller reads as the profiled time of a
    request, here a step) is the mean step time of this workload's sessions. The SLOs: ParaServe's rule over a
    warm request on this data plane (its prompt in chunks, a decode batch of `WARM_BATCH` such sessions)."""
    prof = PAPER_PROFILES.get(model)
    if prof is None or prof.decode_ms is None:
        raise ValueError(f"not a decoder profile: {model!r}; one of {', '.join(GEN_MODELS)}")
    param = prof.size_gb * 1e9 / stages
    kv_stage = kv_bytes_per_token(model) / stages
    kv_tokens = int(KV_MEMORY_SHARE * (gpu_memory_bytes - param) / kv_stage)
    if kv_tokens < MAX_CONTEXT:
        raise ValueError(f"{model} over {stages} stages leaves room for {kv_tokens} KV positions per replica")
    specs = []
    for i in range(stages):
        step = step_time_for(decode_ms=None, prefill_ms_per_token=None, mean_ms=None, cv=0.0, profile=model,
                             stage_bytes=[1] * stages, index=i)
        spec = StageSpec(f"{model}-stage-{i}", 0.0, int(param), activation_bytes(prof), decode_s=step.decode_ms / 1e3,
                         prefill_s_per_token=step.prefill_ms_per_token / 1e3, kv_tokens=kv_tokens,
                         kv_bytes_per_token=kv_stage)
        steps = float(np.sum(new)) or 1.0
        mean_step = float(np.sum(work_per_session_s(spec, prompt, new))) / steps
        specs.append(StageSpec(spec.name, mean_step, spec.param_bytes, spec.activation_bytes, spec.decode_s,
                               spec.prefill_s_per_token, kv_tokens, kv_stage))
    return DecoderModel(model, tuple(specs), *warm_slos(specs, hop_s, prefill_chunk, hbm_bytes_s))


def warm_slos(specs, hop_s: float, prefill_chunk: int, hbm_bytes_s: float) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in seconds by ParaServe §8.1's rule over a warm request on the generation data plane:
    its 1,024-token prompt in chunks through the stages; a decode step of a batch of 8 such sessions."""
    chunks = [min(prefill_chunk, WARM_PROMPT_TOKENS - i) for i in range(0, WARM_PROMPT_TOKENS, prefill_chunk)] \
        if prefill_chunk > 0 else [WARM_PROMPT_TOKENS]
    ttft = sum(max(s.decode_s, c * s.prefill_s_per_token) + hop_s for s in specs for c in chunks)
    tpot = sum(s.decode_s + WARM_BATCH * WARM_PROMPT_TOKENS * s.kv_bytes_per_token / hbm_bytes_s + hop_s
               for s in specs)
    return TTFT_SLO_X * ttft, TPOT_SLO_X * tpot


def session_capacity_rps(dm: DecoderModel, prompt: np.ndarray, new: np.ndarray, slots: int) -> float:
    """Sessions/s the cluster sustains when its GPU slots are split evenly over the stages (busiest stage)."""
    per_stage = slots // len(dm.stages)
    worst = max(float(np.mean(work_per_session_s(s, prompt, new))) for s in dm.stages)
    return per_stage / worst
