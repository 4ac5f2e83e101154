"""One generation burst, one scale-up start mode: the BlitzScale and ParaServe experiments on their own metrics
(issue 29, "Simulator"): TTFT and time between tokens (TBT) of sessions while the cluster scales.

A model of the experiments' tables (parameter bytes, stages, layers per stage) decodes at the rule of the
project's decoder profiles (`quart_stage.presets.PaperProfile.decode_ms`: a token costs a read of the weights
at the GPU's memory bandwidth, ``Calibration.hbm_gbytes_s``), prefills at LLaMA-7B's profiled time per token
scaled by size (`quart_stage.presets.PAPER_PROFILES`), holds fp16 K and V of its architecture per position
(``kv_bytes``) in what its GPU keeps beside the parameters. Sessions take the trace's prompt and output lengths
(random requests of the trace, seeded), Poisson at ``base`` × the initial replicas' capacity, ``burst`` × for
``burst_s``, then ``base`` again; the same sessions for every mode. The data plane is
`quart_tools.sim.generation` (chunked prefill beside continuous batching, sessions pinned per stage, live
replicas' cooperative steps, ParaServe helpers' KV moved on consolidation); SLOs by ParaServe's rule
(`quart_tools.sim.genmodels`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from gateway_plugin.policies import make_policy
from quart_stage.presets import PAPER_PROFILES
from quart_tools.arrivals import Arrivals, load_trace
from quart_tools.genload import generation_stats
from quart_tools.sim.calibration import GB, Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec
from quart_tools.sim.generation import session_lengths
from quart_tools.sim.genmodels import (
    KV_MEMORY_SHARE,
    MAX_CONTEXT,
    MAX_NEW_TOKENS,
    warm_slos,
    work_per_session_s,
)

_LLAMA = PAPER_PROFILES["llama-7b"]
PREFILL_S_PER_TOKEN_PER_BYTE = _LLAMA.exec_ms / 1e3 / _LLAMA.seq / (_LLAMA.size_gb * 1e9)  # LLaMA-7B's, by size
PREFILL_CHUNK = 128
HIDDEN = 4096  # fp16 activations of a 4,096-wide model between stages (and ParaServe parts)
HOP_S = 0.001


def gen_stages(name: str, param_bytes: float, stages: int, kv_bytes: float, gpu_bytes: float, cal: Calibration,
               sessions: Arrivals) -> tuple[StageSpec, ...]:
    """``stages`` even stages of a decoder of ``param_bytes`` with ``kv_bytes`` of K and V per position; the
    profiled time the controller reads is the mean step time of ``sessions``."""
    per = param_bytes / stages
    kv = kv_bytes / stages
    kv_tokens = int(KV_MEMORY_SHARE * (gpu_bytes - per) / kv)
    if kv_tokens < MAX_CONTEXT:
        raise ValueError(f"{name}: {stages} stage(s) on {gpu_bytes / 1e9:g} GB GPUs leave {kv_tokens} KV positions")
    decode = per / (cal.hbm_gbytes_s * GB)
    spec = StageSpec(name, decode, int(per), 0.0, decode_s=decode,
                     prefill_s_per_token=PREFILL_S_PER_TOKEN_PER_BYTE * per, kv_tokens=kv_tokens, kv_bytes_per_token=kv)
    prompt, new = session_lengths(sessions, MAX_CONTEXT, MAX_NEW_TOKENS)
    steps = float(np.sum(np.ceil(prompt / PREFILL_CHUNK) + new - 1))
    step = float(np.sum(work_per_session_s(spec, prompt, new))) / steps
    positions = float(np.sum(prompt + new - 1)) / steps  # what a step carries to the next stage (or part)
    return tuple(replace(spec, name=f"{name}-stage-{i}", service_s=step, activation_bytes=2 * HIDDEN * positions)
                 for i in range(stages))


def session_arrivals(rate: float, base: float, burst: float, warm_s: float, burst_s: float, cool_s: float,
                     seed: int, trace_path: str) -> tuple[Arrivals, float, float]:
    """Poisson sessions (``base``, ``burst``, ``base`` × ``rate``) with the trace's lengths; (arrivals, burst start,
    burst end)."""
    rng = np.random.default_rng(seed)
    parts = []
    for start, span, level in ((0.0, warm_s, base), (warm_s, burst_s, burst), (warm_s + burst_s, cool_s, base)):
        parts.append(np.sort(start + rng.uniform(0.0, span, rng.poisson(level * rate * span))))
    t = np.concatenate(parts)
    trace = load_trace(trace_path)
    pick = rng.integers(0, len(trace.offsets_s), len(t))
    return Arrivals(t, np.ones(len(t), dtype=np.int64), tokens=trace.context_tokens[pick].astype(np.int64),
                    generated=trace.generated_tokens[pick].astype(np.int64), kind="burst"), warm_s, warm_s + burst_s


def capacity_sps(specs: tuple[StageSpec, ...], arrivals: Arrivals) -> float:
    """Sessions/s one replica per stage sustains, bound by its prefill (decodes batch nearly free)."""
    prompt, _ = session_lengths(arrivals, MAX_CONTEXT, MAX_NEW_TOKENS)
    worst = max(float(np.mean(np.maximum(s.decode_s, prompt * s.prefill_s_per_token))) for s in specs)
    return 1.0 / (worst + HOP_S * math.ceil(float(np.mean(prompt)) / PREFILL_CHUNK))


def run_gen_mode(model: str, mode: str, specs: tuple[StageSpec, ...], cal: Calibration, arrivals: Arrivals,
                 window: tuple[float, float], mechanisms: frozenset[str], allcache: bool, initial: int,
                 seed: int, paraserve_max_parts: int) -> dict:
    """One start mode under the generation burst: TTFT, TPOT and TBT of the burst's sessions, steady TBT. The
    controller aims at the TTFT SLO (a step's latency through the pipeline must stay under it): the base load
    then holds the initial replicas in every mode and the burst alone asks for the scale-up the modes differ in
    (with the TPOT SLO, a 128-position prefill chunk alone outlasts it and every mode scales up at the start)."""
    ttft_slo, tpot_slo = warm_slos(specs, HOP_S, PREFILL_CHUNK, cal.hbm_gbytes_s * GB)
    cfg = SimConfig(model=model, stages=specs, slo_s=ttft_slo, calibration=cal, initial_replicas=initial,
                    prewarm_hosts=-1 if allcache else 0, start_mechanisms=mechanisms, queue_cap=10**9,
                    max_replicas=cal.hosts * cal.gpus_per_host // len(specs), seed=seed, drain_s=600.0,
                    record_series=False, cache_on_ready=True, paraserve_max_parts=paraserve_max_parts,
                    paraserve_slo_s=ttft_slo, generation=True, prefill_chunk=PREFILL_CHUNK, hop_s=HOP_S)
    result = Simulation(cfg, make_policy("quart"), arrivals).run()
    lo, hi = window
    burst = (arrivals.times >= lo) & (arrivals.times < hi)
    ok = ~np.isnan(result.latencies_ms)
    stats = generation_stats(result.ttft_ms[burst], result.tpot_ms[burst], ok[burst], 1000 * ttft_slo,
                             1000 * tpot_slo)
    gaps = result.token_gaps
    during = gaps[(gaps[:, 0] >= lo) & (gaps[:, 0] < hi + (hi - lo)), 1]  # the burst and the scale-up after it
    steady = gaps[gaps[:, 0] < lo, 1]
    started = [r for r in result.launched if r.requested_at >= lo and not r.helper]
    asked = min((r.requested_at for r in started), default=math.nan)
    ready = [r.ready_at - asked for r in started if r.requested_at == asked and r.ready_at >= 0]
    row = {
        "mode": mode, "model": model,
        **{k: stats[k] for k in ("requests", "completed", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                                 "ttft_slo_attainment", "tpot_slo_attainment", "slo_attainment")},
        "tbt_p99_ms": float(np.percentile(during, 99)) if len(during) else None,
        "steady_tbt_p99_ms": float(np.percentile(steady, 99)) if len(steady) else None,
        "ready_ms": 1000.0 * float(np.median(ready)) if ready else None,
        "starts": {k: v for k, v in result.starts_by_source.items() if v},
        "ttft_slo_ms": 1000 * ttft_slo, "tpot_slo_ms": 1000 * tpot_slo,
    }
    row["kv_migrations"] = result.kv_migrations  # ParaServe: helpers' sessions moved with their KV, no re-prefill
    if result.paraserve_plans:
        row["paraserve_parts"] = sorted({p for p, _, _ in result.paraserve_plans})
        row["paraserve_helpers"] = sum(1 for r in result.launched if r.helper)
    return row
