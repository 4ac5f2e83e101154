"""`quartctl bench generation`: token generation through the pipeline vs transformers' own `generate`.

SmolLM2-135M-Instruct (real weights, dequantised float32) partitioned into ``--stages`` stages, served by a
`quartctl up`-shaped embedded gateway with the plugin in this process (one KeysManager host; stage
replicas are their own processes with ``--threads`` torch threads each), every request a session
(``POST /function/<model>``, ``stream: true``, greedy, ``ignore_eos``): the stages keep its KV cache, a
step carries one position. The reference is the whole model in this process with the same torch
threads: transformers ``generate(use_cache=True)``, greedy, same prompt ids.

- Rows (``--contexts``, default 32 and 512 prompt tokens, ``--new-tokens`` 64): TTFT = request sent → the
  first token's event; TPOT = (last token − first token) / (n − 1), best of ``--repeats``; the reference
  TTFT = ``generate(max_new_tokens=1)``, its TPOT = (``generate(n)`` − that) / (n − 1), best of repeats,
  pipeline and reference interleaved; ``same_tokens``: the pipeline's tokens equal the reference's.
- Failover: ``--streams`` concurrent streams of ``--new-tokens`` (distinct prompts), stage 1 at two
  replicas; once every stream has a few tokens, one stage-1 replica that holds sessions is ``kill -9``'d.
  ``completed`` (the stream ended with ``[DONE]`` and all its tokens), ``identical`` (tokens equal the
  reference's), ``lost`` (no end, or an error event).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
import torch
from quart_stage import cliargs
from quart_tools.bench import machine_info, system_with_plugin, write_report

TEXT = ("The history of computing is a story of layers. Each generation of machines hid the details of the one "
        "below it behind a simpler interface, and each interface let more people build more things. Vacuum tubes "
        "gave way to transistors, transistors to integrated circuits, and circuits to whole systems on a chip. ")


def prompt_ids(tokenizer, length: int, offset: int = 0) -> list[int]:
    ids = tokenizer.encode(TEXT * (2 + length // 40), add_special_tokens=False)
    return ids[offset:offset + length]


def reference(model, ids: list[int], new_tokens: int, repeats: int) -> tuple[float, float, list[int]]:
    """(TTFT ms, TPOT ms, tokens) of transformers' generate with its KV cache, greedy."""
    x = torch.tensor([ids])
    model.generation_config.eos_token_id = None  # as ignore_eos: exactly new_tokens
    model.generation_config.pad_token_id = 0
    best_first = best_all = float("inf")
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, do_sample=False, use_cache=True)
            t1 = time.perf_counter()
            out = model.generate(x, max_new_tokens=new_tokens, do_sample=False, use_cache=True)
            t2 = time.perf_counter()
            best_first, best_all = min(best_first, t1 - t0), min(best_all, t2 - t1)
            tokens = out[0, len(ids):].tolist()
    return 1000 * best_first, 1000 * (best_all - best_first) / (new_tokens - 1), tokens


async def stream(session: aiohttp.ClientSession, url: str, model: str, ids: list[int], new_tokens: int) -> dict:
    """One greedy session through the gateway: its tokens, TTFT, TPOT, and how it ended."""
    body = {"input_ids": ids, "max_tokens": new_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    out: dict = {"tokens": [], "done": False, "error": None, "replays": 0}
    t0 = time.perf_counter()
    stamps = []
    async with session.post(f"{url}/function/{model}", json=body) as res:
        if res.status != 200:
            out["error"] = f"HTTP {res.status}: {await res.text()}"
            return out
        async for raw in res.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                elif "token" in event and event["token"] is not None:
                    stamps.append(time.perf_counter())
                    out["tokens"].append(event["token"])
                else:
                    out["replays"] = event.get("replays", 0)
    if stamps:
        out["ttft_ms"] = 1000 * (stamps[0] - t0)
        out["tpot_ms"] = 1000 * (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return out


def _pid_of(url: str) -> int | None:
    port = int(url.rstrip("/").rsplit(":", 1)[1].split("/")[0])
    return next((c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
                 and c.laddr.port == port and c.pid), None)


async def failover(url: str, model: str, plugin, prompts: list[list[int]], refs: list[list[int]], new_tokens: int,
                   stage_fn: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.create_task(stream(session, url, model, p, new_tokens)) for p in prompts]
        victim = None
        deadline = time.monotonic() + 300
        while victim is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            live = list(plugin.engine.active.values())
            if len(live) == len(prompts) and all(len(s.generated) >= 4 for s in live):
                index = live[0].stages.index(stage_fn)
                victim = live[0].replicas[index]
        killed = _pid_of(victim.url) if victim is not None else None
        if killed is not None:
            os.kill(killed, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    completed = sum(1 for r in results if r["done"] and r["error"] is None and len(r["tokens"]) == new_tokens)
    identical = sum(1 for r, ref in zip(results, refs, strict=True) if r["tokens"] == ref)
    return {"streams": len(prompts), "completed": completed, "identical": identical,
            "lost": len(prompts) - completed, "killed_pid": killed, "killed_replica": getattr(victim, "id", None),
            "replays": sum(r["replays"] for r in results)}


async def run(stages: int, threads: int, contexts: list[int], new_tokens: int, repeats: int, streams: int,
              work: Path) -> dict:
    from quart_stage.verify import reference_model
    from quart_tools.demo import Demo, partition_model
    from transformers import PreTrainedTokenizerFast

    model_dir = work / f"smollm2-{stages}"
    stack = partition_model("smollm2", stages, model_dir)
    if threads != 1:
        stack.write_text(re.sub(r"QUART_THREADS: ['\"]?\d+['\"]?", f"QUART_THREADS: '{threads}'", stack.read_text()))
    torch.set_num_threads(threads)
    whole = reference_model(str(model_dir))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    os.environ.setdefault("QUART_POLICY", "static")  # nothing scales the stages while they are measured
    system, plugins = await system_with_plugin(work)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            demo = Demo(system, session)
            names = await demo.deploy_ready(stack)
            model = json.loads((model_dir / "manifest.json").read_text())["model"]
            rows = []
            for context in contexts:
                ids = prompt_ids(tokenizer, context)
                await stream(session, system.url, model, ids, 4)  # warm-up
                best: dict = {}
                ref_ttft = ref_tpot = float("inf")
                ref_tokens: list[int] = []
                for _ in range(repeats):
                    got = await stream(session, system.url, model, ids, new_tokens)
                    if got["error"] or not got["done"]:
                        raise RuntimeError(f"context {context}: the stream failed: {got['error']}")
                    best = got if not best else {**best, "ttft_ms": min(best["ttft_ms"], got["ttft_ms"]),
                                                 "tpot_ms": min(best["tpot_ms"], got["tpot_ms"])}
                    t, p, ref_tokens = reference(whole, ids, new_tokens, 1)
                    ref_ttft, ref_tpot = min(ref_ttft, t), min(ref_tpot, p)
                row = {"context": context, "new_tokens": new_tokens, "pipeline_ttft_ms": round(best["ttft_ms"], 2),
                       "pipeline_tpot_ms": round(best["tpot_ms"], 2), "reference_ttft_ms": round(ref_ttft, 2),
                       "reference_tpot_ms": round(ref_tpot, 2), "same_tokens": best["tokens"] == ref_tokens}
                rows.append(row)
                print(f"  context {context}: pipeline TTFT {row['pipeline_ttft_ms']} ms TPOT {row['pipeline_tpot_ms']} "
                      f"ms; reference {row['reference_ttft_ms']} / {row['reference_tpot_ms']} ms; same tokens "
                      f"{row['same_tokens']}", file=sys.stderr)
            middle = names[min(1, len(names) - 1)]
            await demo.scale(middle, 2)
            await demo.wait_available([middle], {middle: 2}, timeout_s=300)
            prompts = [prompt_ids(tokenizer, 32, offset=3 * i) for i in range(streams)]
            refs = [reference(whole, p, new_tokens, 1)[2] for p in prompts]
            fail = await failover(system.url, model, plugins[0], prompts, refs, new_tokens, middle)
            print(f"  failover: {fail}", file=sys.stderr)
    finally:
        await system.stop()
    targets = {
        "tpot_within_1.3x": all(r["pipeline_tpot_ms"] <= 1.3 * r["reference_tpot_ms"] for r in rows),
        "tpot_flat": len(rows) < 2 or rows[-1]["pipeline_tpot_ms"] <= 1.5 * rows[0]["pipeline_tpot_ms"],
        "ttft_within_1.3x_plus_20ms": all(r["pipeline_ttft_ms"] <= 1.3 * r["reference_ttft_ms"] + 20 for r in rows),
        "same_tokens": all(r["same_tokens"] for r in rows),
        "failover": fail["completed"] == streams and fail["identical"] == streams and fail["lost"] == 0,
    }
    return {"benchmark": "generation", "model": "smollm2", "stages": stages, "threads": threads, "rows": rows,
            "failover": fail, "targets": targets,
            "machine": machine_info(torch=torch.__version__, torch_threads=threads, load=os.getloadavg()),
            "method": "pipeline: embedded gateway + KeysManager host, stage replicas as processes, POST "
                      "/function/<model> stream (greedy, ignore_eos), best of repeats; reference: transformers "
                      "generate(use_cache=True) on the whole model in the bench process, same threads, interleaved"}


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench generation", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write JSON here (default stdout)")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of every stage replica and the reference")
    p.add_argument("--contexts", default="32,512", help="prompt lengths in tokens (default 32,512)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row; the best is kept (default 3)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams of the failover run (default 8)")
    p.add_argument("--work", type=Path, default=None, help="folder for the partition and the gateway's state")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        doc = asyncio.run(run(args.stages, args.threads, contexts, args.new_tokens, args.repeats, args.streams,
                              args.work.resolve()))
    else:
        with tempfile.TemporaryDirectory(prefix="quart-bench-generation-") as work:
            doc = asyncio.run(run(args.stages, args.threads, contexts, args.new_tokens, args.repeats, args.streams,
                                  Path(work)))
    write_report(doc, args.out)
    return 0 if all(doc["targets"].values()) else 1
