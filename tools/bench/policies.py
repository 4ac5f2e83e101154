"""`quartctl bench policies`: every scaling policy, live, on the same arrivals, in one run.

What it does (EMULATED compute: replicas sleep for the BERT-21B profile's per-stage times while real
activation bytes travel over real HTTP):
1. partitions the paper's BERT-21B into 8 parameter-free stages (``quartctl partition --weights none``),
2. starts ``quartctl up -f stack.yml`` (embedded gateway, KeysManagers, this plugin) in a subprocess,
3. for every workload (gamma arrivals at CV 1, 4, 8 and the Azure trace, rate-scaled) and every
   policy: sets ``com.quart.keysmanager`` on the stage functions (on for QUART; off for the baselines, as
   the paper ran them, unless ``--baselines-keysmanager on``), resets every stage to ``--start-replicas``
   (static: ``--static-replicas``) under the static policy, switches the plugin to
   the policy under test (``POST /function/quart-plugin/policy``), replays the same arrivals with the
   load generator, and reads the controller's timeline (replicas, queue per stage),
4. writes one JSON report entry per policy and workload (the keys of ``quart_tools.report``) and the
   plots: latency CDF per workload, replicas and queue per stage over time per run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from gateway_plugin.policies import POLICY_NAMES
from quart_stage import cliargs
from quart_tools.bench import machine_info
from tqdm import tqdm

SEQ_TOKENS = 128  # BERT-21B sequence length (Table 1): request bodies are capped to it
PROFILED_MS = 137.0  # BERT-21B standalone execution time, QUART Table 1
MODEL = "bert-21b"
WORKLOADS = ("gamma-cv1", "gamma-cv4", "gamma-cv8", "trace")


def _parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="quartctl bench policies", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-policies.json", help="JSON report (plots go next to it)")
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated policy names")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    p.add_argument("--rate", type=float, default=20.0,
                   help="mean requests/s of every workload (default 20: one replica of a ~17 ms stage serves "
                        "~58/s, so CV 4/8 bursts overload stages and replica capacity is the bottleneck)")
    p.add_argument("--activation-bytes", type=int, default=32 * 1024,
                   help="emulated output bytes per stage and request (QUART_EMULATED_ACTIVATION_BYTES; default "
                        "32 KiB, so our CPU carrying activations is not the bottleneck; 0 = the model's real size, "
                        "1.5 MB per hop for BERT-21B)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--model", default=MODEL, help=f"{MODEL} (default: emulated, parameter-free) or a real pretrained "
                   "model with cpu compute: minilm, smollm2 (--activation-bytes is then the model's own)")
    p.add_argument("--start-replicas", type=int, default=1, help="replicas per stage at the start of each run")
    p.add_argument("--max-replicas", type=int, default=6, help="com.openfaas.scale.max per stage")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--gpus-per-host", type=int, default=24, help="replica slots per simulated host")
    p.add_argument("--static-replicas", type=int, default=2,
                   help="replicas per stage of the static policy (provisioned before its runs start)")
    p.add_argument("--baselines-keysmanager", choices=("off", "on"), default="off",
                   help="off (default, as in the paper): baseline policies' stage functions are deployed with "
                        "com.quart.keysmanager=off, so their scale-ups cold-start; on: baselines fork from the "
                        "KeysManager like QUART (an ablation: the policy alone)")
    p.add_argument("--policy-config", action="append", default=[], metavar="POLICY=JSON",
                   help="settings of one policy (fields of its config dataclass in gateway_plugin.config), e.g. "
                        "quart='{\"correct\": {\"scale_down_cooldown_s\": 3}}'; repeatable")
    p.add_argument("--control-period", type=float, default=1.0,
                   help="seconds between control steps, the same for every policy (QUART_CONTROL_PERIOD_S)")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout (s)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds between the reset and the load")
    p.add_argument("--state-dir", default=None, help="state dir of the gateway (default: a temp dir)")
    p.add_argument("--profile-requests", type=int, default=15, help="sequential requests that set the profiled time")
    p.add_argument("--repeats", type=int, default=1, help="runs per policy and workload, in rotated order")
    p.add_argument("--no-plots", action="store_true")
    return p


class Gateway:
    """`quartctl up` in a subprocess; stopped (process group) on close."""

    def __init__(self, stack: Path, state_dir: Path, hosts: int, gpus: int, env: dict[str, str],
                 extra: tuple[str, ...] = ()) -> None:
        argv = [sys.executable, "-m", "quart_tools.cli", "up", "-f", str(stack), "--port", "0", "--state-dir",
                str(state_dir), "--hosts", str(hosts), "--gpus-per-host", str(gpus), "--no-keep-hosts", *extra]  # stopped: all gone
        self.log_path = state_dir / "up.log"
        state_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **env}, start_new_session=True)
        self.url = ""
        self.param_cache: bool | None = None  # com.quart.keysmanager last set on the stages (None: as deployed)
        self.model = MODEL  # the model whose stages are served
        deadline = time.monotonic() + 300
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            m = re.match(r"Gateway:\s+(\S+)", line)
            if m:
                self.url = m.group(1)
            if line.startswith(("Ready:", "Serving;")):  # `quartctl up`'s last line (tools/platform.py)
                break
            if time.monotonic() > deadline:
                break
        if not self.url or self.proc.poll() is not None:
            self.close()
            raise RuntimeError(f"quartctl up did not start; see {self.log_path}")
        from quart_transport.auth import load_or_create

        creds = load_or_create(state_dir / "secrets")
        self.auth = (creds.user, creds.password)

    def close(self) -> None:
        if self.proc.poll() is None:
            from quart_provider.system import stop_process

            stop_process(self.proc.pid, self.proc, grace_s=20)
        self.log.close()

    def functions(self) -> dict[str, dict]:
        res = requests.get(f"{self.url}/system/functions", auth=self.auth, timeout=10)
        res.raise_for_status()
        return {f["name"]: f for f in res.json()}

    def switch(self, policy: str, config: dict | None = None) -> float:
        res = requests.post(f"{self.url}/function/quart-plugin/policy", json={"policy": policy, "config": config or {}},
                            auth=self.auth, timeout=10)
        if res.status_code != 200:
            raise RuntimeError(f"switching to {policy} failed: {res.status_code} {res.text}")
        return float(res.json()["time"])

    def stages(self, model: str) -> list[str]:
        """The stage functions of ``model`` in pipeline order (``com.quart.stage``)."""
        fns = [(int(st["labels"]["com.quart.stage"]), name) for name, st in self.functions().items()
               if st["labels"].get("com.quart.model") == model]
        return [name for _, name in sorted(fns)]

    def set_param_cache(self, stages: list[str], on: bool) -> None:
        """Redeploy the stage functions with ``com.quart.keysmanager`` on/off (PUT /system/functions, as
        ``faas-cli deploy`` would); running replicas stay, the next ones start from the cache or cold."""
        from gateway_plugin.actuators.rest import deployment_from_status
        from quart_stage.labels import KEYSMANAGER as LABEL_KEYSMANAGER

        fns = self.functions()
        for name in stages:
            body = deployment_from_status(name, fns[name])
            body["labels"] = {**(body.get("labels") or {}), LABEL_KEYSMANAGER: "on" if on else "off"}
            res = requests.put(f"{self.url}/system/functions", json=body, auth=self.auth, timeout=30)
            if res.status_code not in (200, 202):
                raise RuntimeError(f"setting {LABEL_KEYSMANAGER} on {name} failed: {res.status_code} {res.text}")

    def timeline(self, since: float) -> list[dict]:
        res = requests.get(f"{self.url}/function/quart-plugin/timeline", params={"since": since}, timeout=30)
        res.raise_for_status()
        return res.json()

    def snapshot(self) -> dict:
        return requests.get(f"{self.url}/function/quart-plugin/snapshot", timeout=10).json()

    def wait_reset(self, stages: list[str], replicas: int, timeout_s: float = 120.0) -> None:
        """Until every stage has exactly ``replicas`` available and no queue."""
        deadline = time.monotonic() + timeout_s
        while True:
            fns = self.functions()
            snap = self.snapshot().get(self.model, {}).get("stages", [])
            queues = sum(s.get("queue_len", 0) + s.get("busy", 0) for s in snap)
            if all(fns[s]["availableReplicas"] == replicas and fns[s]["replicas"] == replicas for s in stages) \
                    and queues == 0:
                return
            if time.monotonic() > deadline:
                have = {s: (fns[s]["replicas"], fns[s]["availableReplicas"]) for s in stages}
                raise RuntimeError(f"reset to {replicas} replicas did not finish in {timeout_s:.0f} s: {have}")
            time.sleep(0.25)


def profile(gw: Gateway, count: int) -> tuple[float, list[float]]:
    """Median latency of ``count`` sequential requests on the idle pipeline (after 3 warm-ups), and the
    per-stage mean service times the router measured: the "profiled time" SLOs are multiples of."""
    from quart_tools.loadgen import body_maker

    body, ctype = body_maker("input-ids", max_tokens=SEQ_TOKENS)(4 * SEQ_TOKENS)
    lat = []
    for i in range(count + 3):
        t = time.perf_counter()
        res = requests.post(f"{gw.url}/function/{gw.model}", data=body, headers={"Content-Type": ctype}, timeout=60)
        if res.status_code != 200:
            raise RuntimeError(f"profiling request failed: {res.status_code} {res.text[:300]}")
        if i >= 3:
            lat.append(1000 * (time.perf_counter() - t))
    time.sleep(1.5)
    stages = gw.snapshot().get(gw.model, {}).get("stages", [])
    service = [round(1000 / s["service_rate"], 1) if s.get("service_rate") else 0.0 for s in stages]
    return float(sorted(lat)[len(lat) // 2]), service


def make_workload(name: str, rate: float, duration: float, seed: int, trace: str | None = None):
    from quart_tools.arrivals import make_arrivals

    if name.startswith("gamma-cv"):
        return make_arrivals("gamma", rate, duration, cv=float(name.removeprefix("gamma-cv")), seed=seed,
                             input_bytes=512)
    if name == "trace":
        return trace_window(rate, duration, trace)
    raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")


def trace_window(rate: float, duration: float, path: str | None = None):
    """The trace's first ``rate × duration`` requests, compressed in time to fill ``duration``: the replayed
    window has the target mean rate. (Scaling by the whole trace's mean rate would replay its sparse start:
    63 requests in the first 20 s at 20 req/s.) The trace's own gaps, bursts included, are kept in shape."""
    from quart_tools.arrivals import load_trace, replay_trace

    trace = load_trace(path) if path else load_trace()
    n = max(1, round(rate * duration))
    if n >= len(trace.offsets_s) or trace.offsets_s[n] <= 0:
        raise ValueError(f"the trace has too few requests for {rate} req/s over {duration} s")
    return replay_trace(trace, speedup=float(trace.offsets_s[n]) / duration, duration_s=duration)


def policy_config(name: str, args: argparse.Namespace) -> dict:
    config: dict = {"replicas": args.static_replicas} if name == "static" else {}
    for item in args.policy_config:
        policy, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--policy-config wants POLICY=JSON, got {item!r}")
        if policy == name:
            try:
                config.update(json.loads(raw))
            except json.JSONDecodeError as exc:
                raise ValueError(f"--policy-config {policy}: not valid JSON ({exc})") from None
    return config


def samples_from_timeline(rows: list[dict], t0: float) -> list[dict]:
    out = []
    for row in rows:
        for stage, (replicas, queue) in enumerate(zip(row["replicas"], row["queue"], strict=True)):
            out.append({"t": row["time"] - t0, "stage": stage, "replicas": replicas, "queue": queue})
    return out


def partition(out_dir: Path, stages: int, max_replicas: int, activation_bytes: int = 0, model: str = MODEL) -> Path:
    """The paper's BERT-21B, parameter-free and emulated; or a real pretrained model (minilm, smollm2) on cpu."""
    real = model != MODEL
    argv = [sys.executable, "-m", "quart_tools.cli", "partition", "--model", model, "--stages", str(stages),
            "--out", str(out_dir), *(("--compute", "cpu") if real else ("--weights", "none", "--compute", "emulated")),
            "--scale-min", "1", "--scale-max", str(max_replicas), "--concurrency", "1"]
    activation_bytes = 0 if real else activation_bytes
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"partition failed: {res.stderr.strip()[-500:]}")
    stack = out_dir / "stack.yml"
    if activation_bytes > 0:  # every stage function's environment gets the emulated output size
        import yaml

        doc = yaml.safe_load(stack.read_text())
        for fn in doc["functions"].values():
            fn.setdefault("environment", {})["QUART_EMULATED_ACTIVATION_BYTES"] = str(activation_bytes)
        stack.write_text(yaml.safe_dump(doc, sort_keys=False))
    return stack


def run(args: argparse.Namespace) -> dict:
    policies = [p for p in args.policies.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICY_NAMES)}")
    out_path = Path(args.out)
    plot_dir = out_path.with_suffix("")
    tmp = Path(args.state_dir or tempfile.mkdtemp(prefix="quart-bench-policies-"))
    stack = partition(tmp / "model", args.stages, args.max_replicas, args.activation_bytes, args.model)
    env = {"QUART_POLICY": "static", "QUART_CONTROL_PERIOD_S": str(args.control_period), "QUART_WINDOW_S": "5",
           "QUART_REQUEST_TIMEOUT_S": str(args.timeout), "QUART_QUEUE_CAP": "4096"}
    gw = Gateway(stack, tmp / "state", args.hosts, args.gpus_per_host, env)
    gw.model = args.model
    report: dict = {
        "benchmark": "policies", "compute": "emulated" if args.model == MODEL else "cpu", "model": args.model,
        "profiled_ms": PROFILED_MS,
        "stages": args.stages, "rate_rps": args.rate, "activation_bytes": args.activation_bytes, "duration_s": args.duration, "seed": args.seed,
        "start_replicas": args.start_replicas, "max_replicas": args.max_replicas, "repeats": args.repeats,
        "static_replicas": args.static_replicas, "baselines_keysmanager": args.baselines_keysmanager,
        "control_period_s": args.control_period, "policy_config": {p: policy_config(p, args) for p in policies},
        "machine": machine_info(),
        "runs": {},
    }
    latencies: dict[str, dict] = {}
    series: dict[str, dict] = {}
    try:
        stages = gw.stages(gw.model)
        gw.switch("static", {"replicas": args.start_replicas})
        gw.wait_reset(stages, args.start_replicas, timeout_s=600)
        profiled_ms, service_ms = profile(gw, args.profile_requests)
        report["profiled_ms"] = profiled_ms
        report["paper_profiled_ms"] = PROFILED_MS
        report["measured_stage_service_ms"] = service_ms
        print(f"profiled pipeline time on this machine: {profiled_ms:.0f} ms (paper: {PROFILED_MS:.0f} ms); "
              f"stage service ms {service_ms}", file=sys.stderr)
        bar = tqdm(total=len(workloads) * len(policies) * args.repeats, desc="policy runs", unit="run",
                   file=sys.stderr, disable=not sys.stderr.isatty())
        for workload in workloads:
            arrivals = make_workload(workload, args.rate, args.duration, args.seed)
            runs: dict[str, list[dict]] = {p: [] for p in policies}
            for rep in range(args.repeats):
                order = policies[rep % len(policies):] + policies[:rep % len(policies)]  # rotate: no fixed slot
                for policy in order:
                    runs[policy].append(one_run(gw, stages, workload, policy, arrivals, profiled_ms, args))
                    bar.update(1)
            entries = [aggregate(policy, runs[policy], profiled_ms, args) for policy in policies]
            for policy in policies:
                latencies.setdefault(workload, {})[policy] = _concat([r["lat"] for r in runs[policy]])
                series.setdefault(workload, {})[policy] = runs[policy][0]["samples"]
            report["runs"][workload] = entries
            report.setdefault("comparison", {})[workload] = compare(entries, profiled_ms)
    finally:
        gw.close()
    if not args.no_plots:
        plot(plot_dir, latencies, series, report.get("profiled_ms", PROFILED_MS))
        report["plots"] = str(plot_dir)
    return report


def one_run(gw: Gateway, stages: list[str], workload: str, policy: str, arrivals, profiled_ms: float,
            args: argparse.Namespace) -> dict:
    """Reset to the start state, switch to ``policy``, replay ``arrivals``; latencies and stage series."""
    from quart_tools.loadgen import body_maker, generate_load
    from quart_tools.report import build_report, records_latencies

    cache_on = (policy == "quart" and not getattr(args, "cold_starts", False)) or args.baselines_keysmanager == "on"
    if gw.param_cache is not cache_on:
        gw.set_param_cache(stages, cache_on)
        gw.param_cache = cache_on
    start = args.static_replicas if policy == "static" else args.start_replicas  # static is provisioned beforehand
    gw.switch("static", {"replicas": start})
    gw.wait_reset(stages, start)
    time.sleep(args.settle)
    t0 = gw.switch(policy, policy_config(policy, args))
    result = generate_load(f"{gw.url}/function/{gw.model}", arrivals, timeout_s=args.timeout,
                           body=body_maker("input-ids", max_tokens=SEQ_TOKENS), progress=False)
    rows = gw.timeline(t0)
    samples = samples_from_timeline(rows, t0)
    lat, _, n = records_latencies(result.records)
    entry = build_report(policy, lat, profiled_ms, args.duration, n_total=n, samples=samples,
                         end_s=max(args.duration, result.wall_s))
    errors = {str(s): sum(1 for r in result.records if r.status == s)
              for s in sorted({r.status for r in result.records}) if not 200 <= s < 300}
    lags = ready_lags(rows)
    import numpy as np

    send_lag = float(np.percentile([r.send_error_ms for r in result.records], 99)) if result.records else 0.0
    entry["send_error_p99_ms"] = send_lag  # the load generator's own lateness: > a few ms = the machine was starved
    print(f"[{workload}] {policy}: {n} requests, mean {entry['mean_ms']:.0f} ms, p99 {entry['p99_ms']:.0f} ms, "
          f"SLO@1.5 {entry['slo_attainment']['1.5']:.2f}, replica-s {entry['replica_seconds']:.0f}, "
          f"errors {errors}, send-lag p99 {send_lag:.0f} ms", file=sys.stderr)
    return {"lat": lat, "n": n, "entry": entry, "samples": samples, "errors": errors, "lags": lags,
            "keysmanager": "on" if cache_on else "off",
            "timeline": [{k: row.get(k) for k in ("time", "replicas", "desired", "queue", "cpus")} for row in rows]}


def _concat(arrays: list) -> Any:
    import numpy as np

    return np.concatenate(arrays) if arrays else np.array([])


def ready_lags(rows: list[dict]) -> list[float]:
    """Seconds from the controller asking for more replicas of a stage to their being ready.

    An ask counts only while it stands: if a later step asks for fewer before the replicas are ready,
    the ask was withdrawn and is not a sample (counting the next time the stage happens to reach that
    size would charge a later burst's scale-up to this one). Resolution: the control period.
    """
    lags = []
    for i in range(len(rows[0]["desired"]) if rows else 0):
        for k in range(1, len(rows)):
            want = rows[k]["desired"][i]
            if want > rows[k - 1]["desired"][i] and want > rows[k]["replicas"][i]:
                for later in rows[k + 1:]:
                    if later["replicas"][i] >= want:
                        lags.append(round(later["time"] - rows[k]["time"], 2))
                        break
                    if later["desired"][i] < want:
                        break  # withdrawn
    return lags


def aggregate(policy: str, runs: list[dict], profiled_ms: float, args: argparse.Namespace) -> dict:
    """One report entry over the repeats: latencies pooled, replica-seconds and queues averaged."""
    import statistics

    from quart_tools.report import build_report, json_safe

    lat = _concat([r["lat"] for r in runs])
    entry = build_report(policy, lat, profiled_ms, args.duration * len(runs), n_total=sum(r["n"] for r in runs))
    entry["replica_seconds"] = statistics.fmean(r["entry"]["replica_seconds"] or 0.0 for r in runs)
    stages = runs[0]["entry"]["queue_mean_by_stage"].keys()
    entry["queue_mean_by_stage"] = {s: statistics.fmean(r["entry"]["queue_mean_by_stage"].get(s, 0.0) for r in runs)
                                    for s in stages}
    entry["repeats"] = len(runs)
    entry["keysmanager"] = runs[0]["keysmanager"]
    entry["send_error_p99_ms"] = max(r["entry"]["send_error_p99_ms"] for r in runs)
    entry["mean_ms_by_repeat"] = [r["entry"]["mean_ms"] for r in runs]
    entry["errors"] = {k: sum(r["errors"].get(k, 0) for r in runs) for k in {k for r in runs for k in r["errors"]}}
    lags = [x for r in runs for x in r["lags"]]
    entry["replica_ready_lag_s"] = {"count": len(lags), "median": statistics.median(lags) if lags else None,
                                    "max": max(lags) if lags else None}
    entry["timeline"] = runs[0]["timeline"]
    return json_safe(entry)


def compare(entries: list[dict], profiled_ms: float = 0.0) -> dict:
    """QUART against the best baseline of this workload (lowest mean latency; SLO@1.5 separately).

    ``best_possible_mean_ratio``: profiled ÷ the best baseline's mean — what a policy with no queueing at
    all would reach (no request is faster than the idle pipeline); above 0.6 the mean target is out of
    reach by arithmetic. Likewise ``best_possible_slo15_ratio``: 1 ÷ the best baseline's SLO@1.5."""
    quart = next((e for e in entries if e["policy"] == "quart"), None)
    base = [e for e in entries if e["policy"] != "quart" and e.get("mean_ms") is not None]
    if quart is None or not base or quart.get("mean_ms") is None:
        return {}
    best_mean = min(base, key=lambda e: e["mean_ms"])
    best_slo = max(base, key=lambda e: e["slo_attainment"]["1.5"] or 0.0)
    slo_q, slo_b = quart["slo_attainment"]["1.5"] or 0.0, best_slo["slo_attainment"]["1.5"] or 0.0
    return {
        "best_mean_baseline": best_mean["policy"],
        "mean_ratio": quart["mean_ms"] / best_mean["mean_ms"],
        "best_slo_baseline": best_slo["policy"],
        "slo15_ratio": slo_q / slo_b if slo_b > 0 else math.inf if slo_q > 0 else 1.0,
        "replica_seconds_ratio_vs_best_mean": (quart["replica_seconds"] or 0) / (best_mean["replica_seconds"] or 1),
        "best_possible_mean_ratio": profiled_ms / best_mean["mean_ms"] if profiled_ms > 0 else None,
        "best_possible_slo15_ratio": 1.0 / slo_b if slo_b > 0 else math.inf,
        "target_met": quart["mean_ms"] <= 0.6 * best_mean["mean_ms"] + 1e-9 and slo_q >= 1.5 * slo_b - 1e-9
        and (quart["replica_seconds"] or 0) <= (best_mean["replica_seconds"] or 0),
    }


def plot(plot_dir: Path, latencies: dict, series: dict, profiled_ms: float) -> None:
    from quart_tools.report import plot_latency_cdf, plot_stage_series

    plot_dir.mkdir(parents=True, exist_ok=True)
    for workload, by_policy in latencies.items():
        plot_latency_cdf(by_policy, plot_dir / f"cdf-{workload}.png", profiled_ms, title=f"Latency CDF, {workload}")
        for policy, samples in series[workload].items():
            if samples:
                plot_stage_series(samples, plot_dir / f"stages-{workload}-{policy}.png", title=f"{policy}, {workload}")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        report = run(args)
    except (RuntimeError, ValueError) as exc:
        print(f"quartctl bench policies: {exc}", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({"out": args.out, "comparison": report.get("comparison", {})}, indent=2))
    return 0
