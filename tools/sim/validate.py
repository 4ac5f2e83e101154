"""`quartctl bench sim-vs-live [--out FILE]`: the simulator against the live system, same configuration.

Live: the paper's BERT-21B split into 8 parameter-free stages with EMULATED compute (replicas sleep
``--stage-ms`` per request, gamma CV 0.1, while real activation bytes travel over real HTTP), on
`quartctl up` (embedded gateway, KeysManagers, router, controller), driven by the open-loop load
generator with ``--tokens``-token requests. Simulated: the same stages, service-time distribution,
hosts and slots, start replicas, policy and arrival schedule. The stage time (default 100 ms) and one
replica per stage put real queueing into the comparison (ρ ≈ 0.6 at stage 0) at a rate the 2-core
machine can carry; short requests keep the activations (seq × 6144 × fp16) small for the same reason.

Calibration before the comparison: a separate low-rate run on the live system measures the fixed
per-request overhead of the real pipeline (HTTP hops, serialisation, router) as mean latency −
profiled time; the simulator gets it as its per-stage hop time. The measured run then uses other
arrivals at the target rate, so the agreement is not fitted.

Writes ``{"sim": {mean_ms, p99_ms}, "live": {mean_ms, p99_ms}, "agreement": {...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from quart_stage import cliargs
from quart_tools.arrivals import gamma_arrivals, poisson_arrivals
from quart_tools.bench import machine_info, write_report
from quart_tools.report import latency_stats
from quart_tools.sim.calibration import Calibration

MODEL = "bert-21b"
EMULATED_CV = 0.1  # quart_stage's default QUART_EMULATED_CV
TOLERANCE = 0.15


def _parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="quartctl bench sim-vs-live", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON output (default stdout)")
    p.add_argument("--policy", default="static", help="policy on both sides (static keeps scaling out of it)")
    p.add_argument("--replicas", type=int, default=1, help="start replicas per stage (and static's count)")
    p.add_argument("--stage-ms", type=float, default=100.0, help="emulated mean service time of every stage")
    p.add_argument("--tokens", type=int, default=16, help="input tokens per request")
    p.add_argument("--rate", type=float, default=6.0, help="mean requests/s of the measured run")
    p.add_argument("--cv", type=float, default=1.0, help="gamma inter-arrival CV of the measured run")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals of the measured run")
    p.add_argument("--calibration-rate", type=float, default=1.0, help="requests/s of the overhead run")
    p.add_argument("--calibration-duration", type=float, default=20.0)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--gpus-per-host", type=int, default=24)
    p.add_argument("--max-replicas", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--diagnostics-out", default=None,
                   help="JSON with both sides' per-request latencies and replica/queue time series")
    return p


def _stats(lat_ms: np.ndarray) -> dict:
    s = latency_stats(lat_ms)
    return {"mean_ms": s["mean_ms"], "p99_ms": s["p99_ms"], "p50_ms": s["p50_ms"],
            "completed": int(np.count_nonzero(~np.isnan(lat_ms))), "requests": len(lat_ms)}


def simulate(args, arrivals, hop_s: float, start_s: float | None = None, policy_config: dict | None = None,
             cpu_fraction: float | None = None, *, outside_s: float = 0.0, service_cv: float = EMULATED_CV,
             hop_per_call_s: float = 0.0, dispatch_s: float = 0.0) -> dict:
    """The simulated side: same stages, service-time CV, cluster shape, start replicas, policy (and its
    ``policy_config``).

    ``hop_s`` holds the replica (each stage call's time beyond compute), ``outside_s`` is added to every
    request's latency outside the replicas (the router between stages, the front), ``dispatch_s`` delays a call a
    freed replica takes from its queue (the router's dispatch).

    The live stages are emulated and hold no parameters, so a scale-up costs the live ask → ready time
    (``start_s``, measured by the gateway; the calibration's fork cost when not measured), not the paper's
    host → GPU copy of a BERT-21B stage. ``cpu_fraction``: the live stages' ``QUART_EMULATED_CPU_FRACTION``
    (their time at c cores × (1 − f + f/c)); QUART then fits its CPU regression on the same law.
    """
    from gateway_plugin.config import PluginConfig
    from gateway_plugin.policies import make_policy
    from quart_tools.sim.engine import SimConfig, Simulation
    from quart_tools.sim.scenario import model_stages

    cal = replace(Calibration(), hosts=args.hosts, gpus_per_host=args.gpus_per_host, service_cv=service_cv)
    if start_s is not None and start_s >= 0:
        cal = replace(cal, fork_fixed_s=start_s)
    stages = tuple(replace(s, service_s=args.stage_ms / 1000.0, param_bytes=0)
                   for s in model_stages(MODEL, args.stages))
    # The live deploy has no com.quart.profile-ms label: the SLO is slo_factor × the measured stage times.
    cfg = SimConfig(
        model=MODEL, stages=stages, slo_s=0.0, slo_factor=PluginConfig().slo_factor, profile_label=False,
        calibration=cal,
        keysmanager=True, placer="cache-aware", initial_replicas=args.replicas, max_replicas=args.max_replicas,
        window_s=5.0, control_period_s=1.0, queue_cap=4096, hop_s=hop_s, outside_s=outside_s,
        hop_per_call_s=hop_per_call_s, dispatch_s=dispatch_s, seed=args.seed,
    )
    config = {"replicas": args.replicas} if args.policy == "static" else {}
    config.update(policy_config or {})
    if cpu_fraction is not None:
        cfg = replace(cfg, calibration=replace(cal, cpu_fraction=cpu_fraction))
        if args.policy == "quart":
            config["cpu_model"] = cfg.calibration.cpu_model()
    result = Simulation(cfg, make_policy(args.policy, **config), arrivals).run()
    stats = _stats(result.latencies_ms)
    stats.update(replica_seconds=result.gpu_seconds, cpu_seconds=result.cpu_seconds)
    stats["series"] = {"latency_ms": result.latencies_ms.tolist(),
                       "samples": [[s.t, s.stage, s.replicas, s.queue] for s in result.samples],
                       "ready_s_by_source": result.ready_s_by_source}
    return stats


def _partition(out_dir: Path, args) -> Path:
    """`quartctl partition` of the paper model into parameter-free emulated stages of ``stage_ms``."""
    argv = [sys.executable, "-m", "quart_tools.cli", "partition", "--model", MODEL, "--stages", str(args.stages),
            "--out", str(out_dir), "--weights", "none", "--compute", "emulated", "--emulated-mean-ms",
            str(args.stage_ms), "--scale-min", "1", "--scale-max", str(args.max_replicas), "--concurrency", "1"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"partition failed: {res.stderr.strip()[-500:]}")
    return out_dir / "stack.yml"


def live(args, arrivals, calibration_arrivals) -> dict:
    """The live side on `quartctl up`: stats of the measured run, and the calibration run's mean."""
    from quart_tools.bench.policies import Gateway
    from quart_tools.loadgen import body_maker, generate_load
    from quart_tools.report import records_latencies

    tmp = Path(tempfile.mkdtemp(prefix="quart-sim-vs-live-"))
    stack = _partition(tmp / "model", args)
    env = {"QUART_POLICY": "static", "QUART_CONTROL_PERIOD_S": "1", "QUART_WINDOW_S": "5",
           "QUART_REQUEST_TIMEOUT_S": str(args.timeout), "QUART_QUEUE_CAP": "4096"}
    gw = Gateway(stack, tmp / "state", args.hosts, args.gpus_per_host, env)
    url = f"{gw.url}/function/{MODEL}"
    body = body_maker("input-ids", max_tokens=args.tokens)
    try:
        stages = gw.stages(MODEL)
        gw.switch("static", {"replicas": args.replicas})
        gw.wait_reset(stages, args.replicas)
        res = generate_load(url, calibration_arrivals, timeout_s=args.timeout, body=body, progress=False)
        lat, _, _ = records_latencies(res.records)
        calibration_mean_ms = float(np.nanmean(lat))
        gw.wait_reset(stages, args.replicas)
        config = {"replicas": args.replicas} if args.policy == "static" else {}
        t0 = gw.switch(args.policy, config)
        res = generate_load(url, arrivals, timeout_s=args.timeout, body=body, progress=False)
        lat, _, _ = records_latencies(res.records)
        stats = _stats(lat)
        stats["series"] = {"latency_ms": lat.tolist(), "sent_s": [r.sent_s for r in res.records],
                           "timeline": gw.timeline(t0)}
        stats["errors"] = sum(1 for r in res.records if not r.ok)
        starts = [s.get("replica_start_s", -1.0) for s in gw.snapshot().get(MODEL, {}).get("stages", [])]
        starts = [x for x in starts if x is not None and x >= 0]
        stats["replica_start_s"] = float(np.mean(starts)) if starts else None
        stats["calibration_mean_ms"] = calibration_mean_ms
        return stats
    finally:
        gw.close()


def compare(sim: dict, live_stats: dict) -> dict:
    def rel(key: str) -> float:
        a, b = sim[key], live_stats[key]
        return abs(a - b) / b if b and math.isfinite(a) and math.isfinite(b) else math.inf

    mean_err, p99_err = rel("mean_ms"), rel("p99_ms")
    return {"mean_rel_error": mean_err, "p99_rel_error": p99_err, "tolerance": TOLERANCE,
            "within_tolerance": mean_err <= TOLERANCE and p99_err <= TOLERANCE}


def main(argv: list[str]) -> int:
    from quart_tools.report import json_safe

    args = _parser().parse_args(argv)
    started = time.time()
    arrivals = gamma_arrivals(args.rate, args.cv, args.duration, seed=args.seed, input_bytes=4 * args.tokens)
    calibration = poisson_arrivals(args.calibration_rate, args.calibration_duration, seed=args.seed + 1000,
                                   input_bytes=4 * args.tokens)
    try:
        live_stats = live(args, arrivals, calibration)
    except (ImportError, RuntimeError, OSError) as exc:
        print(f"quartctl bench sim-vs-live: the live side could not run: {exc}", file=sys.stderr)
        return 1
    # The real pipeline's fixed overhead (hops, serde, router): live − simulated-without-hops, low rate.
    start_s = live_stats.get("replica_start_s")
    overhead_ms = live_stats["calibration_mean_ms"] - simulate(args, calibration, 0.0, start_s)["mean_ms"]
    hop_s = max(0.0, overhead_ms) / 1000.0 / args.stages
    sim = simulate(args, arrivals, hop_s, start_s)
    series = {"sim": sim.pop("series"), "live": live_stats.pop("series")}
    if args.diagnostics_out:
        Path(args.diagnostics_out).write_text(json.dumps(json_safe(series)) + "\n")
    doc = {
        "sim": sim,
        "live": live_stats,
        "agreement": compare(sim, live_stats),
        "calibrated_hop_ms_per_stage": hop_s * 1000.0,
        "calibrated_start_s": start_s,
        "config": {"model": MODEL, "compute": "emulated", "stages": args.stages, "stage_ms": args.stage_ms,
                   "tokens": args.tokens, "policy": args.policy,
                   "replicas": args.replicas, "rate_rps": args.rate, "cv": args.cv, "duration_s": args.duration,
                   "hosts": args.hosts, "gpus_per_host": args.gpus_per_host, "seed": args.seed},
        "machine": machine_info(loadavg_at_end=round(os.getloadavg()[0], 2)),
        "wall_s": round(time.time() - started, 1),
    }
    write_report(json_safe(doc), args.out, always_print=True)
    return 0
