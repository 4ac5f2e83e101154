"""`quartctl bench realmodel`: the packaged pretrained models, pipeline of stages vs the whole model.

For each model (minilm, smollm2) and cut (``--cuts``), the model is partitioned for real (`partition`, in
a temporary folder) and one request runs in process through every stage's `StageRuntime.handle`, with
the safetensors wire format between stages (encode, decode, validation: every hop but the network),
against the unpartitioned transformers model rebuilt from the same stage files (`verify.reference_model`).
Inputs: MiniLM, three sentences of the known-answer fixture as one padded batch; SmolLM2, the 16-token
ChatML prompt of the fixture. Timings are the best of ``--repeats``, pipeline and whole model
interleaved so machine load hits both alike; torch uses ``--threads`` intra-op threads for both.

Each row: ``{"model", "stages", "max_abs_diff", "pipeline_ms", "whole_model_ms", "hop_budget_ms",
"within_target"}``; the target (issue 19) is max_abs_diff <= 1e-5 and pipeline_ms <= 1.3 x whole_model_ms
+ 2 ms per stage hop.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from quart_stage import cliargs, wire
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_stage.verify import reference_model
from quart_tools.bench import machine_info, write_report
from quart_tools.partition import partition

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "data" / "realmodels_reference.json"
DEFAULT_CUTS = {"minilm": (1, 3, 6), "smollm2": (1, 3, 10, 30)}
TOL = 1e-5


def _inputs(model: str, model_dir: str) -> dict[str, torch.Tensor]:
    fixture = json.loads(FIXTURE.read_text())
    if model == "smollm2":
        return {"input_ids": torch.tensor([fixture["smollm2"]["prompt_ids"]])}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    enc = [tok.encode(s).ids for s in fixture["minilm"]["sentences"]]
    longest = max(map(len, enc))
    return {"input_ids": torch.tensor([e + [0] * (longest - len(e)) for e in enc]),
            "attention_mask": torch.tensor([[1] * len(e) + [0] * (longest - len(e)) for e in enc])}


def measure(model: str, stages: int, work: str, repeats: int, threads: int) -> dict:
    """One row: partition `model` into `stages`, chain the stages, compare with the whole model."""
    model_dir = str(Path(work) / f"{model}-{stages}")
    partition(model, stages, model_dir, progress=False)
    runtimes = [StageRuntime.load(StageConfig(model_dir=model_dir, stage_index=i, threads=threads))
                for i in range(stages)]
    for rt in runtimes:
        rt.prepare_device()
    whole = reference_model(model_dir)
    inputs = _inputs(model, model_dir)
    torch.set_num_threads(threads)

    def pipeline() -> torch.Tensor:
        body = wire.encode_bytes(inputs)
        for rt in runtimes:
            resp = rt.handle(body, {"Content-Type": wire.CONTENT_TYPE})
            if resp.status != 200:
                raise RuntimeError(f"{model} stage {rt.stage_index}: {resp.status} {resp.body[:200]!r}")
            body = resp.body
        return wire.decode(body).tensors["logits"]

    def whole_model() -> torch.Tensor:
        with torch.inference_mode():
            return whole(**inputs).logits

    got, expected = pipeline(), whole_model()  # warm-up, and the outputs compared
    best_pipe = best_whole = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        pipeline()
        t1 = time.perf_counter()
        whole_model()
        t2 = time.perf_counter()
        best_pipe, best_whole = min(best_pipe, t1 - t0), min(best_whole, t2 - t1)
    diff = (got - expected).abs().max().item()
    pipe_ms, whole_ms = best_pipe * 1e3, best_whole * 1e3
    budget = 1.3 * whole_ms + 2.0 * (stages - 1)
    return {"model": model, "stages": stages, "max_abs_diff": diff, "pipeline_ms": round(pipe_ms, 3),
            "whole_model_ms": round(whole_ms, 3), "hop_budget_ms": round(budget, 3),
            "within_target": bool(diff <= TOL and pipe_ms <= budget), "exact": diff == 0.0,
            "input_shape": list(inputs["input_ids"].shape)}


def run(cuts: dict[str, tuple[int, ...]], repeats: int = 10, threads: int = 1) -> dict:
    rows = []
    for model, stage_counts in cuts.items():
        for stages in stage_counts:
            with tempfile.TemporaryDirectory(prefix="quart-bench-realmodel-") as work:
                row = measure(model, stages, work, repeats, threads)
            rows.append(row)
            print(f"  {model:8} {stages:3} stages: max|diff| {row['max_abs_diff']:.2e}  pipeline "
                  f"{row['pipeline_ms']:8.2f} ms  whole {row['whole_model_ms']:8.2f} ms  "
                  f"(budget {row['hop_budget_ms']:.2f} ms) {'ok' if row['within_target'] else 'OVER'}",
                  file=sys.stderr)
    return {"benchmark": "realmodel",
            "machine": machine_info(torch=torch.__version__, torch_threads=threads),
            "method": "best of repeats, interleaved; pipeline = StageRuntime.handle of every stage in process, "
                      "safetensors wire between stages; whole = the transformers model of the same weights",
            "rows": rows}


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench realmodel", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write JSON here (default stdout)")
    p.add_argument("--models", default="minilm,smollm2", help="comma separated (default minilm,smollm2)")
    p.add_argument("--cuts", default=None,
                   help="stage counts, comma separated, for every model (default minilm 1,3,6; smollm2 1,3,10,30)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per row; the best is kept (default 10)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(DEFAULT_CUTS))
    if unknown:
        p.error(f"--models: unknown {unknown[0]!r}; one of {', '.join(DEFAULT_CUTS)}")
    cuts = {m: tuple(int(c) for c in args.cuts.split(",")) if args.cuts else DEFAULT_CUTS[m] for m in models}
    write_report(run(cuts, args.repeats, args.threads), args.out)
    return 0
