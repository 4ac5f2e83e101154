"""`quartctl bench batching`: dynamic batching of one-shot passes at the router, off vs on (docs/batching.md).

MiniLM (real weights, real CPU compute) partitioned into ``--stages`` stages and deployed on the embedded
gateway with one replica per stage (its stage processes, one request at a time each, ``--threads`` torch
threads). The client sends open-loop Poisson arrivals, stepped up in rate (``--rates``, ``--step-s`` seconds
each), of safetensors ``input_ids`` of 6–30 tokens (tokenized sentences of different lengths), to
``POST /function/<model>``; every rate runs with batching off (``com.quart.batch.max`` 1) and then on
(``--batch-max``), on the same arrivals, in the same system: only the router's batch limit changes between the
two (the lowest rate runs off, on, on, off, its two runs of each pooled). The SLO is 5 × the unloaded latency (the p50 of ``--unloaded`` sequential requests, batching off);
``max_rate_within_slo`` is the highest rate whose p99 is within it with every request answered 200.

JSON: ``{"oneshot": {"model", "stages", "slo_ms", "unloaded_ms", "rows": [{"batching", "rate", "p50_ms", "p99_ms",
"ok", "lost", "sent", "refused"}], "max_rate_within_slo": {"off", "on"}}, "targets", "machine"}``. ``lost``: a
request without any answer; ``refused``: an explicit non-200 answer (429, 504). The decode half (continuous
batching of generation steps, SmolLM2): ``quart_tools.bench.decode_batching``, under the key ``decode``;
``--part`` runs one half.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from quart_tools.arrivals import Arrivals, poisson_arrivals
from quart_tools.bench import machine_info, system_with_plugin, write_report
from quart_tools.bench.batching_physics import CpuMeter, compute_profile, gain, machine_ceiling, theory
from quart_tools.bench.decode_batching import add_arguments as add_decode_arguments
from quart_tools.bench.decode_batching import run_decode
from quart_tools.realmodels import REAL_MODELS, package_path

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars watch the quiet river flow past "
         "old stone bridges and green fields under a pale autumn sky").split()
DEFAULT_RATES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)


def _percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2) if values else float("nan")


def _bodies(model_dir: Path, lengths: range) -> dict[int, bytes]:
    """One safetensors ``input_ids`` body per token count (a tokenized sentence, cut to that many tokens)."""
    import torch
    from quart_stage import wire
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(" ".join(WORDS * 2)).ids
    out = {}
    for n in lengths:
        cut = ids[: n - 1] + [ids[-1]]  # [CLS] words … [SEP]
        out[n] = wire.encode_bytes({"input_ids": torch.tensor([cut], dtype=torch.int64)})
    return out


def _arrivals(rate: float, step_s: float, seed: int, lengths: range) -> Arrivals:
    arr = poisson_arrivals(rate, step_s, seed=seed)
    rng = np.random.default_rng(seed + 1)
    sizes = rng.integers(lengths.start, lengths.stop, size=len(arr)).astype(np.int64)
    return Arrivals(times=arr.times, sizes=sizes, kind="poisson")


def _row(batching: str, rate: float, records, cpu: list[dict]) -> dict:
    ok = [r.latency_ms for r in records if r.ok]
    lost = sum(1 for r in records if r.status == 0)
    return {"batching": batching, "rate": rate, "p50_ms": _percentile(ok, 50), "p99_ms": _percentile(ok, 99),
            "ok": len(ok), "lost": lost, "sent": len(records), "refused": len(records) - len(ok) - lost,
            "cpu_ms_per_request": {k: round(float(np.mean([c[k] for c in cpu])), 2) for k in cpu[0]}}


async def run(args: argparse.Namespace, work: Path) -> dict:
    import aiohttp
    from gateway_plugin.batching import BatchLimits
    from quart_tools.demo import Demo, partition_model
    from quart_tools.loadgen import run_load

    model_dir = work / f"minilm-{args.stages}"
    stack = partition_model("minilm", args.stages, model_dir)
    text = stack.read_text().replace("QUART_THREADS: '1'", f"QUART_THREADS: '{args.threads}'")
    stack.write_text(text)
    lengths = range(6, 31)
    bodies = _bodies(model_dir, lengths)
    os.environ["QUART_POLICY"] = "static"  # one replica per stage, nothing scales while measured
    os.environ["QUART_CONCURRENCY"] = "1"
    system, plugins = await system_with_plugin(work)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            names = await Demo(system, session).deploy_ready(stack)
            model = json.loads((model_dir / "manifest.json").read_text())["model"]
            url = f"{system.url}/function/{model}"
            batcher = plugins[0].router.batcher

            def set_batch(most: int) -> None:
                limits = BatchLimits(most)
                batcher.limits = lambda fn: limits

            set_batch(1)
            unloaded = []
            for k in range(args.unloaded + 3):  # 3 warm-up requests
                n = lengths[k % len(lengths)]
                t0 = time.perf_counter()
                async with session.post(url, data=bodies[n], headers={"Content-Type": "application/octet-stream"}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"unloaded request: HTTP {r.status}")
                if k >= 3:
                    unloaded.append(1000 * (time.perf_counter() - t0))
            unloaded_ms = float(np.median(unloaded))
            slo_ms = 5 * unloaded_ms
            print(f"  unloaded p50 {unloaded_ms:.1f} ms, SLO {slo_ms:.1f} ms", file=sys.stderr)
            rows = []
            over = {"off": 0, "on": 0}
            meter = CpuMeter()
            for step, rate in enumerate(args.rates):
                arrivals = _arrivals(rate, args.step_s, seed=100 + step, lengths=lengths)
                # the lowest rate (the p50 comparison) runs off, on, on, off, the others off, on and on, off in
                # turn: drift in the machine's load hits both
                order = ("off", "on", "on", "off") if step == 0 else ("off", "on") if step % 2 else ("on", "off")
                records: dict[str, list] = {"off": [], "on": []}
                cpu: dict[str, list] = {"off": [], "on": []}
                for mode in order:
                    if over[mode] >= 2:  # past its limit twice: no need to load it further
                        continue
                    set_batch(1 if mode == "off" else args.batch_max)
                    meter.start()
                    result = await run_load(url, arrivals, timeout_s=max(2.0, 4 * slo_ms / 1000),
                                            body=lambda n: (bodies[int(n)], "application/octet-stream"),
                                            headers={"X-Quart-Timeout-Ms": str(int(max(2000, 4 * slo_ms)))},
                                            progress=False)
                    records[mode].extend(result.records)
                    cpu[mode].append(meter.per_request_ms(len(result.records)))
                    await asyncio.sleep(1.0)  # drain between runs
                for mode in ("off", "on"):
                    if not records[mode]:
                        continue
                    row = _row(mode, rate, records[mode], cpu[mode])
                    rows.append(row)
                    within = row["ok"] == row["sent"] and row["p99_ms"] <= slo_ms
                    over[mode] = 0 if within else over[mode] + 1
                    print(f"  {mode:3} {rate:5g} req/s: p50 {row['p50_ms']} p99 {row['p99_ms']} ms, ok {row['ok']}/"
                          f"{row['sent']}, lost {row['lost']}, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
                if over["off"] >= 2 and over["on"] >= 2:
                    break
            sizes = {fn: plugins[0].collector.stage(fn).batch_service_s() for fn in names}
    finally:
        await system.stop()

    def best(mode: str) -> float:
        good = [r["rate"] for r in rows if r["batching"] == mode and r["ok"] == r["sent"] and r["p99_ms"] <= slo_ms]
        return max(good, default=0.0)

    off, on = best("off"), best("on")
    at1 = {r["batching"]: r["p50_ms"] for r in rows if r["rate"] == args.rates[0]}
    oneshot = {"model": "minilm", "stages": args.stages, "slo_ms": round(slo_ms, 2), "unloaded_ms": round(unloaded_ms, 2),
               "batch_max": args.batch_max, "rows": rows, "max_rate_within_slo": {"off": off, "on": on},
               "service_by_batch": {fn: [{"size": s, "calls": n, "mean_ms": round(1000 * m, 2)} for s, n, m in v]
                                    for fn, v in sizes.items()}}
    # the physics: the same stages in this process, no HTTP, and transformers' own model (tools/bench/batching_physics.py)
    mix = [int(n) for n in np.random.default_rng(7).integers(lengths.start, lengths.stop, size=16)]
    oneshot["profile"] = compute_profile(model_dir, args.stages, args.threads, bodies, mix,
                                         reference=package_path(REAL_MODELS["minilm"]))
    oneshot["theory"] = physics(oneshot, rows, off, args.batch_max)
    for key in ("mixed", "uniform"):
        t = oneshot["theory"][key]
        print(f"  physics ({key} lengths, in process): max rate off {t['max_rate_off']}, on {t['max_rate_on']} "
              f"(batch {t['batch_within_slo']}) = {t['ratio']}x; at any batch ≤ {t['ratio_at_any_batch']}x",
              file=sys.stderr)
    print(f"  bound: {oneshot['theory']['bound']}", file=sys.stderr)
    targets = {"max_rate_on_ge_3x_off": off > 0 and on >= 3 * off,
               f"p50_at_{args.rates[0]:g}_on_le_1.1x_off": at1.get("on", 1e9) <= 1.1 * at1.get("off", 0),
               "lost_0": all(r["lost"] == 0 for r in rows)}
    return {"benchmark": "batching", "oneshot": oneshot, "targets": targets,
            "machine": machine_info(torch_threads=args.threads, load=os.getloadavg()),
            "method": f"embedded gateway + one stage process per stage (concurrency 1), open-loop Poisson, "
                      f"{args.step_s:g} s per rate, same arrivals off and on, 6-30 tokens per request"}


def physics(oneshot: dict, rows: list[dict], off: float, batch_max: int, cpus: int | None = None) -> dict:
    """What this machine allows, from the bench's own measurements: the fitted profile's rates (:func:`theory`), the
    measured batching gain of our stage path and of transformers' own model within the SLO (:func:`gain`), the
    whole machine's CPU ceiling (:func:`machine_ceiling`), and the bound they set together on on / off."""
    profile, slo_ms, unloaded_ms = oneshot["profile"], oneshot["slo_ms"], oneshot["unloaded_ms"]
    out = {key: theory(profile, f"{key}_ms", slo_ms, unloaded_ms, batch_max) for key in ("mixed", "uniform")}
    out["gain_ours"] = gain(profile, "mixed_ms", "alone_ms", slo_ms, unloaded_ms)
    if "transformers_ms" in profile[0]:
        out["gain_transformers"] = gain(profile, "transformers_ms", "transformers_alone_ms", slo_ms, unloaded_ms)
    out["machine"] = machine_ceiling(rows, cpus or os.cpu_count() or 1, off)
    limits = {"fit_within_slo": out["mixed"]["ratio"], "measured_gain_within_slo": out["gain_ours"]["ratio_within_slo"]}
    if out["machine"].get("ceiling_over_off") and off > min(r["rate"] for r in rows):  # off past the idle step
        limits["machine_cpu"] = out["machine"]["ceiling_over_off"]
    out["bound"] = {"ratio": min(limits.values()), "by": min(limits, key=limits.get), "limits": limits}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="quartctl bench batching", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the JSON here (default: stdout)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    p.add_argument("--batch-max", type=int, default=16)
    p.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES))
    p.add_argument("--step-s", type=float, default=8.0, help="seconds of arrivals per rate (≤ 15)")
    p.add_argument("--unloaded", type=int, default=30, help="sequential requests for the unloaded latency")
    p.add_argument("--part", choices=("both", "oneshot", "decode"), default="both", help="which half to run")
    add_decode_arguments(p)
    args = p.parse_args(argv)
    if not 0 < args.step_s <= 15:
        p.error("--step-s must be in (0, 15]")
    with tempfile.TemporaryDirectory(prefix="quart-batching-") as work:
        report = asyncio.run(run(args, Path(work))) if args.part in ("both", "oneshot") else {
            "benchmark": "batching", "targets": {}, "machine": machine_info(torch_threads=1, load=os.getloadavg())}
        if args.part in ("both", "decode"):
            decode, targets = asyncio.run(run_decode(args, Path(work)))
            report["decode"] = decode
            report["targets"].update(targets)
            report["machine"]["load_after_decode"] = list(os.getloadavg())
    write_report(report, args.out)
    return 0 if all(report["targets"].values()) else 1
