"""The decode half of `quartctl bench batching`: continuous batching of generation steps (docs/batching.md#decode).

SmolLM2-135M-Instruct (real weights, dequantised float32) in ``--stages`` stages on the embedded gateway, one
replica (stage process) per stage (scale.min = scale.max = 1) (concurrency 1, one torch thread), decode batching on (``QUART_GEN_DECODE_BATCH_MAX``
= ``--decode-batch-max``, ``QUART_GEN_DECODE_HOLD_MS`` = ``--hold-ms``; ``--no-hold`` also runs the most streams
with the hold off). For each count of concurrent streams (``--streams``, default 1 2 4 8 16) that many
greedy streams (``POST /function/<model>``, ``stream: true``, ``ignore_eos``) of ``--new-tokens`` tokens after
prompts of ``--context`` tokens start together. ``tokens_per_s``: every token of every stream / the wall time
from the first request to the last stream's end; ``tpot_*``: percentiles of the gaps between consecutive tokens
of a stream, pooled over the streams. ``same_tokens``: every stream's tokens equal transformers'
``generate`` (greedy, the whole model) on its prompt. With ``--off`` the largest stream count also runs with
decode batching off (every step its own call), same prompts. With ``--stage-step`` the report also has
``stage_step``: one batched step in process, ragged vs padded caches vs transformers' own
(:mod:`quart_tools.bench.decode_stage`).

JSON (the ``decode`` key of the batching report): ``{"model", "stages", "context", "new_tokens", "rows":
[{"streams", "batching", "hold_ms", "tokens_per_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "same_tokens"}],
"batch_sizes": {replica: {size: calls}}}``; targets: 16 streams ≥ 4 × one stream's tokens/s, TPOT p50 at
16 ≤ 3 × one stream's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
from quart_tools.bench.decode_stage import stage_step_rows

DEFAULT_STREAMS = (1, 2, 4, 8, 16)


async def _stream(session, url: str, ids: list[int], new_tokens: int) -> tuple[list[int], list[float], float]:
    """One greedy stream: its tokens, the time of each, and when it was sent."""
    body = {"input_ids": ids, "max_tokens": new_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    tokens, stamps, t0 = [], [], time.perf_counter()
    async with session.post(url, json=body) as res:
        if res.status != 200:
            raise RuntimeError(f"stream: HTTP {res.status}: {(await res.text())[:300]}")
        async for raw in res.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream: {event['error']}")
                if event.get("token") is not None:
                    tokens.append(event["token"])
                    stamps.append(time.perf_counter())
    if len(tokens) != new_tokens:
        raise RuntimeError(f"stream ended after {len(tokens)} of {new_tokens} tokens")
    return tokens, stamps, t0


async def _row(session, url: str, prompts: list[list[int]], refs: list[list[int]], new_tokens: int,
               batching: str, hold_ms: float) -> dict:
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(_stream(session, url, p, new_tokens) for p in prompts))
    wall = max(stamps[-1] for _, stamps, _ in runs) - t0
    gaps = [1000 * (b - a) for _, stamps, _ in runs for a, b in zip(stamps, stamps[1:], strict=False)]
    ttft = [1000 * (stamps[0] - sent) for _, stamps, sent in runs]
    return {"streams": len(prompts), "batching": batching, "hold_ms": hold_ms,
            "tokens_per_s": round(len(prompts) * new_tokens / wall, 2),
            "tpot_p50_ms": round(float(np.percentile(gaps, 50)), 2), "tpot_p99_ms": round(float(np.percentile(gaps, 99)), 2),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 2),
            "same_tokens": all(tokens == ref for (tokens, _, _), ref in zip(runs, refs, strict=True))}


async def run_decode(args, work: Path) -> tuple[dict, dict]:
    """The ``decode`` section and its targets."""
    import aiohttp
    import torch
    from quart_stage.verify import reference_model
    from quart_tools.bench import system_with_plugin
    from quart_tools.bench.generation import prompt_ids, reference
    from quart_tools.demo import Demo, partition_model
    from transformers import PreTrainedTokenizerFast

    model_dir = work / f"smollm2-{args.decode_stages}"
    stack = partition_model("smollm2", args.decode_stages, model_dir)
    # one replica per stage (the static policy keeps scale.min..scale.max: both 1)
    stack.write_text(re.sub(r"(com\.openfaas\.scale\.(?:min|max)): ['\"]?\d+['\"]?", r"\1: '1'", stack.read_text()))
    torch.set_num_threads(1)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    most = max(args.streams)
    prompts = [prompt_ids(tokenizer, args.context, offset=3 * i) for i in range(most)]
    whole = reference_model(str(model_dir))
    refs = [reference(whole, p, args.new_tokens, 1)[2] for p in prompts]
    del whole
    stage_step = stage_step_rows(model_dir, 64, args.step_rounds) if args.stage_step else []
    if stage_step:
        print(f"  stage step (ms): {stage_step}", file=sys.stderr)
    os.environ.update({"QUART_POLICY": "static", "QUART_CONCURRENCY": "1",
                       "QUART_GEN_DECODE_BATCH_MAX": str(args.decode_batch_max), "QUART_GEN_DECODE_HOLD_MS": str(args.hold_ms)})
    system, plugins = await system_with_plugin(work)
    rows = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await Demo(system, session).deploy_ready(stack)
            model = json.loads((model_dir / "manifest.json").read_text())["model"]
            url = f"{system.url}/function/{model}"
            engine = plugins[0].engine
            await _stream(session, url, prompts[0], 4)  # warm-up
            for n in args.streams:
                rows.append(await _row(session, url, prompts[:n], refs[:n], args.new_tokens, "on", args.hold_ms))
                print(f"  decode {n:2} streams: {rows[-1]}, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
            sizes = engine.batch_sizes()
            if args.no_hold:
                engine.config = dataclasses.replace(engine.config, decode_hold_ms=0)
                rows.append(await _row(session, url, prompts, refs, args.new_tokens, "on", 0))
                print(f"  decode {most:2} streams, no hold: {rows[-1]}, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
            if args.off:
                engine.decode_limit = lambda fn: 1
                rows.append(await _row(session, url, prompts, refs, args.new_tokens, "off", 0))
                print(f"  decode {most:2} streams, batching off: {rows[-1]}", file=sys.stderr)
    finally:
        await system.stop()
    on = {r["streams"]: r for r in rows if r["batching"] == "on" and r["hold_ms"] == args.hold_ms}
    one, top = on.get(1), on.get(16)
    targets = {"decode_same_tokens": all(r["same_tokens"] for r in rows)}
    if one and top:
        targets["decode_16_streams_ge_4x_tokens_per_s"] = top["tokens_per_s"] >= 4 * one["tokens_per_s"]
        targets["decode_16_streams_tpot_p50_le_3x"] = top["tpot_p50_ms"] <= 3 * one["tpot_p50_ms"]
    decode = {"model": "smollm2", "stages": args.decode_stages, "context": args.context,
              "new_tokens": args.new_tokens, "decode_batch_max": args.decode_batch_max, "hold_ms": args.hold_ms, "rows": rows,
              "batch_sizes": sizes, "stage_step": stage_step}
    return decode, targets


def add_arguments(p) -> None:
    p.add_argument("--decode-stages", type=int, default=3)
    p.add_argument("--streams", type=int, nargs="+", default=list(DEFAULT_STREAMS))
    p.add_argument("--context", type=int, default=32, help="prompt tokens per stream")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-batch-max", type=int, default=16)
    p.add_argument("--hold-ms", type=float, default=250.0,
                   help="QUART_GEN_DECODE_HOLD_MS: most a free replica holds its batch for its sessions' steps on their way")
    p.add_argument("--no-hold", action="store_true", help="also run the most streams with the hold off (0 ms)")
    p.add_argument("--off", action="store_true", help="also run the most streams with decode batching off")
    p.add_argument("--stage-step", action="store_true",
                   help="also time one batched step in process: ragged vs padded caches vs transformers (decode_stage)")
    p.add_argument("--step-rounds", type=int, default=10, help="decode rounds per --stage-step figure (median)")
