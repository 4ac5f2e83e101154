"""`quartctl bench stage-generation`: token generation through in-process stages vs transformers' `generate`.

SmolLM2-135M (real weights) partitioned into ``--stages`` stages (a temporary folder); a generation session
runs through every stage's `StageRuntime.handle` in one process (the protocol of docs/generation.md: prefill,
then one-position decode steps; the safetensors wire between stages, JSON token answers; every hop but the
network), against the whole transformers model's `generate(do_sample=False, use_cache=True)` of the same
weights, in the same run, same torch thread count (``--threads``). TTFT: prompt to first token. TPOT: mean
time per token after the first (the reference's per-token times come from a StoppingCriteria that stamps
each token). Each row is the best of ``--repeats`` runs (as `bench realmodel`), pipeline and reference
interleaved (order alternating). On a loaded machine whole runs drift apart, so each row also has ``interleaved_*``: decode steps
alternating token by token between the pipeline and the whole model's forward with its cache (the step
`generate` runs), medians. Prompts are random token ids (fixed seed) of ``--contexts`` lengths.

Row: ``{"context", "new_tokens", "pipeline_ttft_ms", "pipeline_tpot_ms", "reference_ttft_ms",
"reference_tpot_ms", "tpot_ratio", "same_tokens", "interleaved_pipeline_step_ms", "interleaved_reference_step_ms",
"interleaved_ratio"}``. Target (issue 27): pipeline TPOT <= 1.3x the
reference's, TPOT(512) <= 1.5x TPOT(32), same_tokens everywhere.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from quart_stage import cliargs
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_stage.verify import reference_model
from quart_tools.bench import machine_info, write_report
from quart_tools.partition import partition
from quart_tools.stagechain import generate, session_step


class _Stamps:
    """A StoppingCriteria that records when each token is produced (never stops generation itself)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def reference_run(model, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """Greedy generate with the KV cache: (tokens, TTFT s, TPOT s)."""
    from transformers import StoppingCriteriaList

    stamps = _Stamps()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                             do_sample=False, use_cache=True, stopping_criteria=StoppingCriteriaList([stamps]),
                             pad_token_id=0)
    times = [t0, *stamps.times]
    gaps = [b - a for a, b in zip(times[1:], times[2:], strict=False)]
    return out[0, len(prompt):].tolist(), times[1] - t0, sum(gaps) / len(gaps)


def interleaved_steps(runtimes, model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """Decode steps alternating token by token between the pipeline session and the whole model's forward with
    its DynamicCache (what `generate` runs per token), so machine load hits both alike: the median step (s) of
    each."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        token = int(model(torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                    .logits[0, -1].argmax())
    session_step(runtimes, prompt, 0, "bench-interleaved")
    pipe, ref, pos = [], [], len(prompt)
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        t1 = time.perf_counter()
        session_step(runtimes, [token], pos, "bench-interleaved")
        t2 = time.perf_counter()
        token, pos = int(logits[0, -1].argmax()), pos + 1
        ref.append(t1 - t0)
        pipe.append(t2 - t1)
    for rt in runtimes:
        rt.generation.table.drop("bench-interleaved")
    return statistics.median(pipe), statistics.median(ref)


def measure(runtimes, model, context: int, new_tokens: int, repeats: int, vocab: int) -> dict:
    prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    rows = []
    for k in range(repeats + 1):  # the first run of each side warms up; the order alternates
        if k % 2:
            got = generate(runtimes, prompt, new_tokens, session=f"bench-{context}-{k}")
            ref_tokens, ref_ttft, ref_tpot = reference_run(model, prompt, new_tokens)
        else:
            ref_tokens, ref_ttft, ref_tpot = reference_run(model, prompt, new_tokens)
            got = generate(runtimes, prompt, new_tokens, session=f"bench-{context}-{k}")
        if k:
            rows.append((got.ttft_s, got.tpot_s, ref_ttft, ref_tpot, got.tokens == ref_tokens))
    best = [min(r[i] for r in rows) * 1e3 for i in range(4)]  # best run of each: load spikes filtered out
    pipe_step, ref_step = interleaved_steps(runtimes, model, prompt, new_tokens)
    return {"context": context, "new_tokens": new_tokens,
            "pipeline_ttft_ms": round(best[0], 2), "pipeline_tpot_ms": round(best[1], 3),
            "reference_ttft_ms": round(best[2], 2), "reference_tpot_ms": round(best[3], 3),
            "tpot_ratio": round(best[1] / best[3], 3), "same_tokens": all(r[4] for r in rows),
            "interleaved_pipeline_step_ms": round(pipe_step * 1e3, 3),
            "interleaved_reference_step_ms": round(ref_step * 1e3, 3),
            "interleaved_ratio": round(pipe_step / ref_step, 3)}


def run(stages: int = 3, contexts: tuple[int, ...] = (32, 512), new_tokens: int = 64, repeats: int = 4,
        threads: int = 1) -> dict:
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="quart-bench-stagegen-") as work:
        model_dir = str(Path(work) / "smollm2")
        manifest = partition("smollm2", stages, model_dir, progress=False)
        runtimes = [StageRuntime.load(StageConfig(model_dir=model_dir, stage_index=i, threads=threads))
                    for i in range(stages)]
        for rt in runtimes:
            rt.prepare_device()
        model = reference_model(model_dir)
        model.generation_config.eos_token_id = None  # all new_tokens, as the pipeline session generates them
        torch.set_num_threads(threads)
        rows = []
        for context in contexts:
            row = measure(runtimes, model, context, new_tokens, repeats, int(manifest.config["vocab_size"]))
            rows.append(row)
            print(f"  context {context:5}: TPOT pipeline {row['pipeline_tpot_ms']:8.2f} ms  reference "
                  f"{row['reference_tpot_ms']:8.2f} ms  ({row['tpot_ratio']:.2f}x)  TTFT {row['pipeline_ttft_ms']:8.1f}"
                  f" / {row['reference_ttft_ms']:8.1f} ms  same tokens: {row['same_tokens']}  interleaved steps "
                  f"{row['interleaved_pipeline_step_ms']:.2f} / {row['interleaved_reference_step_ms']:.2f} ms "
                  f"({row['interleaved_ratio']:.2f}x)", file=sys.stderr)
    return {"benchmark": "stage-generation", "model": "smollm2", "stages": stages, "threads": threads,
            "machine": machine_info(torch=torch.__version__, torch_threads=threads,
                                    load_avg={"start": list(load_start), "end": list(os.getloadavg())}),
            "method": "best of repeats, interleaved (order alternating); interleaved_*: medians of decode steps "
                      "alternating token by token; pipeline = StageRuntime.handle of every stage in one process "
                      "(generation session: prefill, then one-position decode steps); reference = transformers "
                      "generate(do_sample=False, use_cache=True) of the same weights",
            "rows": rows}


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench stage-generation", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write JSON here (default stdout)")
    p.add_argument("--stages", type=int, default=3, help="stage count (default 3)")
    p.add_argument("--contexts", default="32,512", help="prompt lengths, comma separated (default 32,512)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (default 64)")
    p.add_argument("--repeats", type=int, default=4,
                   help="timed runs per row after a warm-up; the best is kept (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides (default 1)")
    args = p.parse_args(argv)
    contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
    write_report(run(args.stages, contexts, args.new_tokens, args.repeats, args.threads), args.out)
    return 0
