"""`quartctl bench hop-costs`: what the live frontier setup spends outside the emulated compute, per stage.

The live system of `quartctl bench frontier` (emulated BERT-21B, 8 parameter-free stages, 32 KiB activations,
`quartctl up` with the router writing per-request records, ``QUART_RECORDS``), driven twice: sequential
requests on the idle pipeline, then Poisson arrivals at the frontier's rate with enough replicas per stage
that nothing queues. From the router's records (per stage: wait, round trip to the replica, the replica's own
compute time) and the load generator's latencies, per request:

- ``compute_factor``: the replica's measured compute ÷ its nominal emulated time (the sleep's timer overshoot);
- ``stage_hold_ms``: round trip − compute, per stage call: HTTP, (de)serialisation, the replica's framework —
  time the replica is held beyond its compute;
- ``stage_gap_ms``: router latency − Σ (waits + round trips), per stage: the router's hand-over between stages,
  time outside any replica and any queue (``wait_ms``: the queue, and the dispatch when a replica is free);
- ``entry_ms``: client latency − router latency: the gateway front and the client's own HTTP;
- ``dispatch_ms``: when a replica's call ends with a request already waiting for its stage, the time until that
  request's call starts (the call launched, its task run; the replica sits idle meanwhile): the mean over such
  back-to-back calls (``dispatch_calls``, ``dispatch_p90_ms`` their p90), 0 when none;
- ``service_cv``: CV of the round trip (the spread the simulator's service times get);
- ``hold_per_call_ms``: how much a call's hold grows per stage call in flight beside it (least squares of hold on
  the calls in flight at its midpoint, itself included; ``hold_at_one_ms`` the line at one call): the 2-core
  host's CPU shared by the calls' HTTP and serialisation work. The loaded phase has bursty (gamma, ``--cv``)
  arrivals so that the calls in flight span a range.

``--calibration FILE`` writes the loaded phase's figures into a calibration JSON (`quart_tools.sim.calibration`)
with their sources; `quartctl bench frontier` measures the same before its runs and gives them to the simulator.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from quart_stage import cliargs
from quart_tools.bench import machine_info, write_report

DEFAULT_RATE = 20.0


def _parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="quartctl bench hop-costs", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON report (default stdout)")
    p.add_argument("--calibration", default=None,
                   help="calibration JSON to update with the loaded phase's figures (e.g. tools/sim/calibration.live.json)")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE, help="requests/s of the loaded phase (the frontier's)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals of the loaded phase")
    p.add_argument("--cv", type=float, default=4.0, help="gamma inter-arrival CV of the loaded phase (bursts)")
    p.add_argument("--replicas", type=int, default=6, help="replicas per stage (enough that nothing queues)")
    p.add_argument("--idle-requests", type=int, default=30, help="sequential requests of the idle phase")
    p.add_argument("--activation-bytes", type=int, default=32 * 1024)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--gpus-per-host", type=int, default=24)
    p.add_argument("--seed", type=int, default=7, help="arrivals of the loaded phase (not the frontier's seed)")
    return p


def nominal_stage_ms(stages: int) -> float:
    """The emulated mean service time of one stage: BERT-21B's Table 1 time split evenly (no weights)."""
    from quart_tools.bench.policies import PROFILED_MS

    return PROFILED_MS / stages


def calls_in_flight(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(hold ms, stage calls in flight at the call's midpoint, itself included) of every stage call of the
    records, its start placed at the router's arrival + the earlier waits and round trips + its own wait."""
    spans, holds = [], []
    for r in records:
        t = r["arrival"]
        for v in r["stages"]:
            t += v["wait_ms"] / 1000.0
            spans.append((t, t + v["service_ms"] / 1000.0))
            holds.append(v["service_ms"] - v["compute_ms"])
            t += v["service_ms"] / 1000.0
    if not spans:
        return np.array([]), np.array([])
    starts, ends = np.sort([a for a, _ in spans]), np.sort([b for _, b in spans])
    mids = np.array([(a + b) / 2 for a, b in spans])
    return np.array(holds), np.searchsorted(starts, mids, side="right") - np.searchsorted(ends, mids, side="right")


def dispatch_gaps(records: list[dict]) -> np.ndarray:
    """Seconds from a replica's call end to its next call's start, for every next call that was already waiting
    when the first ended (times placed as in `calls_in_flight`; a gap below 0 from that placement counts as 0)."""
    by_replica: dict[str, list[tuple[float, float, float]]] = {}
    for r in records:
        t = r["arrival"]
        for v in r["stages"]:
            enqueued = t
            t += v["wait_ms"] / 1000.0
            by_replica.setdefault(v.get("replica", ""), []).append((t, t + v["service_ms"] / 1000.0, enqueued))
            t += v["service_ms"] / 1000.0
    gaps = []
    for calls in by_replica.values():
        calls.sort()
        gaps += [max(0.0, b[0] - a[1]) for a, b in zip(calls, calls[1:], strict=False) if b[2] < a[1]]
    return np.array(gaps)


def hold_fit(holds: np.ndarray, calls: np.ndarray) -> tuple[float, float]:
    """(hold at one call in flight, growth per call) of a least-squares line; no growth when the calls in flight
    do not vary, and never a negative one."""
    if len(holds) < 3 or np.ptp(calls) == 0:
        return (float(holds.mean()) if len(holds) else 0.0), 0.0
    slope, intercept = np.polyfit(calls.astype(float), holds, 1)
    slope = max(0.0, float(slope))
    return (float(intercept) + slope if slope > 0 else float(holds.mean())), slope


def decompose(records: list[dict], client_ms: list[float], stages: int, nominal_ms: float) -> dict:
    """Means per stage call (ms) of the router's successful records and the client's latencies (see the module)."""
    ok = [r for r in records if 200 <= r.get("status", 0) < 300 and len(r.get("stages", [])) == stages]
    if not ok:
        raise ValueError("no successful router records with every stage")
    visits = [v for r in ok for v in r["stages"]]
    service = np.array([v["service_ms"] for v in visits])
    compute = np.array([v["compute_ms"] for v in visits])
    wait = np.array([v["wait_ms"] for v in visits])
    router = np.array([r["latency_ms"] for r in ok])
    inside = np.array([sum(v["service_ms"] + v["wait_ms"] for v in r["stages"]) for r in ok])
    client = np.array([x for x in client_ms if np.isfinite(x)])
    per_stage = [float(np.mean([r["stages"][i]["service_ms"] for r in ok])) for i in range(stages)]
    holds, calls = calls_in_flight(ok)
    at_one, per_call = hold_fit(holds, calls)
    gaps = dispatch_gaps(ok)
    return {
        "requests": len(ok),
        "client_mean_ms": float(client.mean()) if client.size else None,
        "client_median_ms": float(np.median(client)) if client.size else None,
        "router_mean_ms": float(router.mean()),
        "service_ms": float(service.mean()),
        "service_cv": float(service.std() / service.mean()) if service.mean() > 0 else 0.0,
        "service_p99_ms": float(np.percentile(service, 99)),
        "service_ms_by_stage": [round(x, 2) for x in per_stage],
        "compute_ms": float(compute.mean()),
        "compute_factor": float(compute.mean() / nominal_ms) if nominal_ms > 0 else 1.0,
        "wait_ms": float(wait.mean()),
        "stage_hold_ms": float((service - compute).mean()),
        "stage_gap_ms": float((router - inside).mean() / stages),
        "entry_ms": float(client.mean() - router.mean()) if client.size else 0.0,
        "dispatch_ms": 1000.0 * float(gaps.mean()) if gaps.size else 0.0,
        "dispatch_p90_ms": 1000.0 * float(np.percentile(gaps, 90)) if gaps.size else 0.0,
        "dispatch_calls": int(gaps.size),
        "calls_in_flight_mean": float(calls.mean()),
        "hold_at_one_ms": at_one,
        "hold_per_call_ms": per_call,
    }


def calibration_fields(loaded: dict, source: str) -> tuple[dict, dict]:
    """(Calibration fields, their sources) of a loaded-phase decomposition."""
    values = {"live_compute_factor": loaded["compute_factor"], "live_stage_hold_s": loaded["hold_at_one_ms"] / 1000.0,
              "live_hold_per_call_s": loaded["hold_per_call_ms"] / 1000.0,
              "live_stage_gap_s": loaded["stage_gap_ms"] / 1000.0, "live_entry_s": loaded["entry_ms"] / 1000.0,
              "live_dispatch_s": loaded.get("dispatch_ms", 0.0) / 1000.0, "live_service_cv": loaded["service_cv"]}
    what = {"live_compute_factor": "replica compute ms / nominal emulated ms",
            "live_stage_hold_s": "router round trip - replica compute, per stage call, at one call in flight",
            "live_hold_per_call_s": "growth of that hold per stage call in flight (least squares)",
            "live_stage_gap_s": "(router latency - sum of waits and round trips) / stages",
            "live_entry_s": "client latency - router latency",
            "live_dispatch_s": "a freed replica's idle time before its next waiting call starts (router dispatch)",
            "live_service_cv": "CV of the router's round trips"}
    return values, {k: f"live: {v} ({source})" for k, v in what.items()}


def update_calibration(path: str | Path, loaded: dict, source: str) -> None:
    """Rewrite the calibration JSON at ``path`` with the loaded phase's figures and their sources."""
    from quart_tools.sim.calibration import Calibration

    cal = Calibration.load(path) if Path(path).exists() else Calibration()
    values, sources = calibration_fields(loaded, source)
    cal = replace(cal, **values, sources={**cal.sources, **sources})
    Path(path).write_text(json.dumps(cal.to_json(), indent=2) + "\n")


def _read_records(path: Path, skip: int) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines[skip:] if line.strip()]


def measure(gw, stages: list[str], records_path: Path, *, rate: float, duration: float, replicas: int,
            idle_requests: int, seed: int, cv: float = 4.0) -> dict:
    """Both phases on a running gateway that writes router records to ``records_path``: {"idle", "loaded"}."""
    import requests
    from quart_tools.arrivals import gamma_arrivals
    from quart_tools.bench.batching_physics import CpuMeter
    from quart_tools.bench.policies import SEQ_TOKENS
    from quart_tools.loadgen import body_maker, generate_load
    from quart_tools.report import records_latencies

    nominal = nominal_stage_ms(len(stages))
    gw.switch("static", {"replicas": replicas})
    gw.wait_reset(stages, replicas, timeout_s=600)
    make = body_maker("input-ids", max_tokens=SEQ_TOKENS)
    body, ctype = make(4 * SEQ_TOKENS)
    url = f"{gw.url}/function/{gw.model}"
    for _ in range(3):  # warm-up, not counted
        requests.post(url, data=body, headers={"Content-Type": ctype}, timeout=60)
    time.sleep(0.5)
    mark = len(_read_records(records_path, 0))
    idle_ms = []
    for _ in range(idle_requests):
        t = time.perf_counter()
        res = requests.post(url, data=body, headers={"Content-Type": ctype}, timeout=60)
        if res.status_code == 200:
            idle_ms.append(1000 * (time.perf_counter() - t))
    time.sleep(0.5)
    idle_records = _read_records(records_path, mark)
    mark += len(idle_records)
    arrivals = gamma_arrivals(rate, cv, duration, seed=seed, input_bytes=4 * SEQ_TOKENS)
    meter = CpuMeter()
    meter.start()
    started, started_unix = time.perf_counter(), time.time()
    res = generate_load(url, arrivals, timeout_s=30.0, body=make, progress=False)
    wall = time.perf_counter() - started
    cpu = meter.per_request_ms(len(arrivals))
    lat, _, _ = records_latencies(res.records)
    time.sleep(0.5)
    loaded = decompose(_read_records(records_path, mark), list(lat), len(stages), nominal)
    loaded.update(rate_rps=rate, cv=cv, duration_s=duration, replicas=replicas, started_unix=started_unix,
                  cpu_ms_per_request=cpu, cpu_cores_busy=round(sum(cpu.values()) * len(arrivals) / 1000 / wall, 3))
    return {"nominal_stage_ms": nominal, "idle": decompose(idle_records, idle_ms, len(stages), nominal),
            "loaded": loaded}


def records_env(records_path: Path) -> dict[str, str]:
    """The gateway environment of the frontier setup, with the router writing its records to ``records_path``."""
    return {"QUART_POLICY": "static", "QUART_CONTROL_PERIOD_S": "1.0", "QUART_WINDOW_S": "5",
            "QUART_REQUEST_TIMEOUT_S": "30", "QUART_QUEUE_CAP": "4096", "QUART_RECORDS": str(records_path)}


def run(args: argparse.Namespace) -> dict:
    import os

    from quart_tools.bench.policies import MODEL, Gateway, partition

    tmp = Path(tempfile.mkdtemp(prefix="quart-bench-hop-costs-"))
    stack = partition(tmp / "model", args.stages, args.replicas, args.activation_bytes, MODEL)
    records_path = tmp / "records.jsonl"
    load_start = round(os.getloadavg()[0], 2)
    gw = Gateway(stack, tmp / "state", args.hosts, args.gpus_per_host, records_env(records_path))
    try:
        stages = gw.stages(MODEL)
        costs = measure(gw, stages, records_path, rate=args.rate, duration=args.duration, replicas=args.replicas,
                        idle_requests=args.idle_requests, seed=args.seed, cv=args.cv)
    finally:
        gw.close()
    return {"benchmark": "hop-costs", "model": MODEL, "compute": "emulated", "stages": args.stages,
            "activation_bytes": args.activation_bytes, **costs,
            "machine": machine_info(loadavg_at_start=load_start, loadavg_at_end=round(os.getloadavg()[0], 2))}


def main(argv: list[str]) -> int:
    from quart_tools.report import json_safe

    args = _parser().parse_args(argv)
    try:
        doc = run(args)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"quartctl bench hop-costs: {exc}", file=sys.stderr)
        return 1
    if args.calibration:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        update_calibration(args.calibration, doc["loaded"],
                           f"`quartctl bench hop-costs` {stamp}, {args.rate:g} req/s, load {doc['machine']['loadavg_at_end']}")
    write_report(json_safe(doc), args.out, always_print=not args.out)
    print(json.dumps({k: {m: doc[k][m] for m in ("client_mean_ms", "router_mean_ms", "service_ms", "compute_factor",
                                                 "stage_hold_ms", "stage_gap_ms", "entry_ms", "dispatch_ms", "dispatch_p90_ms",
                                                 "dispatch_calls", "service_cv",
                                                 "wait_ms")}
                      for k in ("idle", "loaded")}, indent=1), file=sys.stderr)
    return 0


def sim_terms(costs: dict, stages: int) -> dict:
    """The simulator's inputs for the live setup from measured costs (``decompose``'s loaded phase, or
    ``costs_of(calibration)``): the stage's mean compute (nominal × overshoot), the hold per call (a fixed part and
    its growth per call in flight), the time outside the replicas, the router's dispatch of a waiting call, and the
    compute's CV that gives the round trip its measured CV."""
    compute_ms = nominal_stage_ms(stages) * costs["compute_factor"]
    round_trip_ms = compute_ms + costs["stage_hold_ms"]
    per_call = costs.get("hold_per_call_ms", 0.0)
    at_one = max(0.0, costs.get("hold_at_one_ms", costs["stage_hold_ms"]))  # a fitted line may cross 0 below 2 calls
    return {"stage_ms": compute_ms, "hop_s": (at_one - per_call) / 1000.0 if per_call else costs["stage_hold_ms"] / 1000.0,
            "hop_per_call_s": per_call / 1000.0,
            "outside_s": (stages * costs["stage_gap_ms"] + costs["entry_ms"]) / 1000.0,
            "dispatch_s": costs.get("dispatch_ms", 0.0) / 1000.0,
            "service_cv": costs["service_cv"] * round_trip_ms / compute_ms}


def costs_of(cal) -> dict:
    """A calibration's recorded live costs (``Calibration.live_*``) in ``decompose``'s keys."""
    return {"compute_factor": cal.live_compute_factor, "stage_hold_ms": 1000.0 * cal.live_stage_hold_s,
            "hold_at_one_ms": 1000.0 * cal.live_stage_hold_s, "hold_per_call_ms": 1000.0 * cal.live_hold_per_call_s,
            "stage_gap_ms": 1000.0 * cal.live_stage_gap_s, "entry_ms": 1000.0 * cal.live_entry_s,
            "dispatch_ms": 1000.0 * cal.live_dispatch_s, "service_cv": cal.live_service_cv}
