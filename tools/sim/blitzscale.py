"""`quartctl simulate --experiment blitzscale`: one burst, every scale-up start mode, at the BlitzScale paper's
fabric (issue 16 item 5, issue 17 item 5). Simulated: the live controller (QUART's policy) and placer on the
simulated cluster (`quart_tools.sim.engine`), the start modes of `quart_tools.sim.starting`.

Fabric (BlitzScale Table 1, per GPU): 100 Gbit/s RDMA between hosts, 128 Gbit/s PCIe host → GPU, 10 Gbit/s
from storage. One simulated host is one GPU with its own NIC and PCIe link (the paper's per-GPU figures), 16
of them (cluster B: 2 × 8 A100). Models at the paper's sizes (fp16): Llama-2-7B and Llama-3-8B as one stage,
Llama-2-70B as 4 pipeline stages (the paper runs it on 4 GPUs). The service times are assumptions (prefill of
a moderate batch; the paper's TTFT SLOs are 450 ms for 7B and 1250 ms for 70B).

The burst: Poisson arrivals at ``base`` × the initial replicas' capacity, then ``burst`` × for ``burst_s``, then
``base`` again; the same arrivals (same seed) for every mode. The modes:

- ``allcache``: every host holds every stage in its host cache (KeysManager fork; BlitzScale's AllCache);
- ``registry-cold``: only the hosts of the initial replicas hold it; new replicas load from storage;
  (every mode: a host caches the stage once its replica has loaded it, so a later start there is a fork)
- ``peer-fetch``: from a holder over the network (receivers on one source share its NIC);
- ``multicast``: chain multicast from the holders;
- ``live``: chain multicast + live scaling (BlitzScale: new replicas serve the layers they hold);
- ``paraserve``: new replicas load from storage in P-host groups that serve as sub-pipelines, then consolidate.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
from gateway_plugin.policies import make_policy
from quart_tools.arrivals import Arrivals
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.engine import SimConfig, Simulation, StageSpec

MODES: dict[str, tuple[frozenset[str], bool]] = {  # mode → (start mechanisms, every host caches every stage)
    "allcache": (frozenset(), True),
    "registry-cold": (frozenset(), False),
    "peer-fetch": (frozenset({"peer"}), False),
    "multicast": (frozenset({"peer", "multicast"}), False),
    "live": (frozenset({"peer", "multicast", "live"}), False),
    "paraserve": (frozenset({"paraserve"}), False),
}

# BlitzScale Table 1 (cluster B), per GPU; one simulated host = one GPU.
FABRIC = {
    "hosts": 16,
    "gpus_per_host": 1,
    "nic_gbit_s": 100.0,  # RDMA between hosts
    "h2d_gbit_s": 128.0,  # PCIe host → GPU
    "storage_gbit_s": 10.0,  # SSD → GPU (the registry / cold path)
    "registry_gbit_s": 400.0,  # assumption: the storage behind the hosts serves 400 Gbit/s in all
}

# name → (parameter bytes, stages, layers per stage, service s per stage (assumed), SLO s (paper's TTFT SLO),
# initial replicas per stage)
MODELS: dict[str, tuple[float, int, int, float, float, int]] = {
    "llama2-7b": (13.5e9, 1, 32, 0.10, 0.45, 2),
    "llama3-8b": (16.1e9, 1, 32, 0.12, 0.45, 2),
    "llama2-70b": (138e9, 4, 20, 0.15, 1.25, 1),
}
# generation (--workload generation): fp16 K and V bytes per position of the published architectures (Llama-2-7B
# 32 layers × 32 KV heads × 128; Llama-3-8B 32 × 8 (GQA) × 128; Llama-2-70B 80 × 8 × 128) and the GPU's memory
GEN_KV_BYTES = {"llama2-7b": 2 * 32 * 32 * 128 * 2, "llama3-8b": 2 * 32 * 8 * 128 * 2, "llama2-70b": 2 * 80 * 8 * 128 * 2}
GPU_BYTES = 80e9  # BlitzScale's A100s (80 GB)
PARASERVE_MAX_PARTS = 4  # ParaServe §8 runs P ≤ 4 (larger P gains little)
PEAK_FRACTION = 0.75  # the burst's peak needs at most this share of the replicas the cluster can hold per stage


def fabric_calibration(base: Calibration, model: str, fabric: dict | None = None) -> Calibration:
    """``base`` (its fixed start costs: live KeysManager fork / cold) at ``fabric`` (default `FABRIC`, the
    paper's) for ``model``."""
    fab = {**FABRIC, **(fabric or {})}
    layers = MODELS[model][2]
    src = dict(base.sources)
    src.update({
        "nic_gbytes_s": f"BlitzScale Table 1: 100 Gbit/s RDMA per GPU (this run: {fab['nic_gbit_s']:g})",
        "h2d_gbps": "BlitzScale Table 1: 128 Gbit/s PCIe host → GPU",
        "disk_gbps": "BlitzScale Table 1: 10 Gbit/s SSD → GPU (the cold path)",
        "registry_gbytes_s": "assumption: 400 Gbit/s of storage in all",
        "hosts": "BlitzScale Table 1, cluster B: 2 × 8 GPUs; one simulated host per GPU (its own NIC and PCIe)",
        "live_layers": f"{model}: layers per stage",
    })
    return replace(base, hosts=fab["hosts"], gpus_per_host=fab["gpus_per_host"],
                   nic_gbytes_s=fab["nic_gbit_s"] / 8, h2d_gbps=fab["h2d_gbit_s"] / 8,
                   disk_gbps=fab["storage_gbit_s"] / 8, registry_gbytes_s=fab["registry_gbit_s"] / 8,
                   live_layers=layers, service_cv=0.1, sources=src)


def burst_arrivals(rate: float, base: float, burst: float, warm_s: float, burst_s: float, cool_s: float,
                   seed: int) -> tuple[Arrivals, float, float]:
    """Poisson arrivals: ``base`` × rate, ``burst`` × rate from ``warm_s`` for ``burst_s``, then ``base``.
    Returns (arrivals, burst start, burst end)."""
    rng = np.random.default_rng(seed)
    times: list[np.ndarray] = []
    for start, span, level in ((0.0, warm_s, base), (warm_s, burst_s, burst), (warm_s + burst_s, cool_s, base)):
        n = rng.poisson(level * rate * span)
        times.append(np.sort(start + rng.uniform(0.0, span, n)))
    t = np.concatenate(times)
    return Arrivals(times=t, sizes=np.ones(len(t), dtype=np.int64), kind="burst"), warm_s, warm_s + burst_s


def run_mode(model: str, mode: str, cal: Calibration, arrivals: Arrivals, window: tuple[float, float],
             initial: int = 2, seed: int = 0) -> dict:
    """One mode on one model: the row {mode, ready_ms, first_served_ms, burst_mean_ms, burst_p99_ms, ...}."""
    size, stages, _, service_s, slo_s, _ = MODELS[model]
    mechanisms, allcache = MODES[mode]
    specs = tuple(StageSpec(f"{model}-stage-{i}", service_s, int(size / stages), activation_bytes=2 * 4096 * 512)
                  for i in range(stages))
    cfg = SimConfig(model=model, stages=specs, slo_s=slo_s, calibration=cal, initial_replicas=initial,
                    prewarm_hosts=-1 if allcache else 0, start_mechanisms=mechanisms, queue_cap=10**9,
                    max_replicas=cal.hosts // stages, seed=seed, drain_s=300.0, record_series=False,
                    cache_on_ready=True, paraserve_max_parts=PARASERVE_MAX_PARTS)
    result = Simulation(cfg, make_policy("quart"), arrivals).run()
    lo, hi = window
    in_burst = (arrivals.times >= lo) & (arrivals.times < hi)
    lat = result.latencies_ms[in_burst]
    done = lat[~np.isnan(lat)]
    started = [r for r in result.launched if r.requested_at >= lo]
    asked = min((r.requested_at for r in started), default=math.nan)  # the burst's first scale-up
    first_batch = [r for r in started if r.requested_at == asked and not r.helper]
    ready = [r.ready_at - asked for r in first_batch if r.ready_at >= 0]
    served = [r.first_done for r in started if r.first_done >= 0]
    row = {
        "mode": mode,
        "model": model,
        "ready_ms": 1000.0 * float(np.median(ready)) if ready else None,  # the first scale-up's replicas
        "last_ready_ms": 1000.0 * float(max(ready)) if ready else None,
        "first_scale_up_replicas": len(first_batch),
        "first_scale_up_at_s": asked,
        "first_served_ms": 1000.0 * (min(served) - asked) if served else None,
        "burst_mean_ms": float(done.mean()) if len(done) else None,
        "burst_p99_ms": float(np.percentile(done, 99)) if len(done) else None,
        "burst_requests": int(in_burst.sum()),
        "burst_unfinished": int(in_burst.sum() - len(done)),
        "slo_attainment": float((done <= 1000.0 * slo_s).sum() / max(1, in_burst.sum())),
        "starts": {k: v for k, v in result.starts_by_source.items() if v},
    }
    if result.paraserve_plans:
        row["paraserve_parts"] = sorted({p for p, _, _ in result.paraserve_plans})
        row["paraserve_helpers"] = sum(1 for r in result.launched if r.helper)
    return row


def run_blitzscale(models: list[str], cal: Calibration, seed: int = 0, base: float = 0.5, burst: float = 4.0,
                   warm_s: float = 30.0, burst_s: float = 30.0, cool_s: float = 30.0,
                   fabric: dict | None = None, workload: str = "oneshot", trace_path: str = "") -> dict:
    """Every mode on every model, the same burst per model; rows and the issue's check (live vs allcache).

    The burst is ``burst`` × the initial replicas' capacity, lowered where the cluster could not serve it
    (the peak needs at most `PEAK_FRACTION` of the replicas per stage: as BlitzScale scales its traces).
    ``fabric`` overrides entries of `FABRIC` (e.g. ``{"nic_gbit_s": 200.0}``). ``workload="generation"``: sessions
    with the trace's lengths, judged on TTFT and TBT (`quart_tools.sim.genburst`).
    """
    unknown = set(fabric or {}) - set(FABRIC)
    if unknown:
        raise ValueError(f"fabric: unknown {sorted(unknown)}; known: {', '.join(FABRIC)}")
    fab = {**FABRIC, **(fabric or {})}
    if workload == "generation":
        return run_blitzscale_generation(models, cal, seed, base, burst, (warm_s, burst_s, cool_s), fab, trace_path)
    rows, checks, bursts = [], {}, {}
    for model in models:
        mcal = model_calibration(cal, model, fab)
        _, stages, _, service_s, _, initial = MODELS[model]
        capacity = initial / service_s  # requests/s the initial replicas of one stage sustain
        level = min(burst, PEAK_FRACTION * (mcal.hosts // stages) / initial)
        bursts[model] = {"initial_replicas": initial, "burst_x_capacity": level, "capacity_rps": capacity}
        arrivals, lo, hi = burst_arrivals(capacity, base, level, warm_s, burst_s, cool_s, seed)
        by_mode = {m: run_mode(model, m, mcal, arrivals, (lo, hi), initial, seed) for m in MODES}
        rows.extend(by_mode.values())
        live, ref = by_mode["live"]["burst_p99_ms"], by_mode["allcache"]["burst_p99_ms"]
        checks[model] = {"live_p99_over_allcache": live / ref if live and ref else None,
                         "target": 1.2, "met": bool(live and ref and live <= 1.2 * ref)}
    return {
        "fabric": fab,
        "models": {m: {**dict(zip(("param_bytes", "stages", "layers_per_stage", "service_s", "slo_s",
                                   "initial_replicas"), MODELS[m], strict=True)), **bursts[m]} for m in models},
        "burst": burst_doc(base, burst, (warm_s, burst_s, cool_s), seed, "poisson"),
        "policy": POLICY,
        "rows": rows,
        "check_live_p99_within_1.2x_allcache": checks,
        "simulated": True,
    }


POLICY = "quart (the live controller, gateway_plugin.controller)"


def burst_doc(base: float, burst: float, spans: tuple[float, float, float], seed: int, arrivals: str) -> dict:
    warm_s, burst_s, cool_s = spans
    return {"base_x_capacity": base, "burst_x_capacity": burst, "warm_s": warm_s, "burst_s": burst_s,
            "cool_s": cool_s, "seed": seed, "arrivals": arrivals}


def model_calibration(cal: Calibration, model: str, fab: dict) -> Calibration:
    if model not in MODELS:
        raise ValueError(f"models: unknown {model!r}; one of {', '.join(MODELS)}")
    return fabric_calibration(cal, model, fab)


def run_blitzscale_generation(models: list[str], cal: Calibration, seed: int, base: float, burst: float,
                              spans: tuple[float, float, float], fab: dict, trace_path: str) -> dict:
    """Every mode on every model under one generation burst: TTFT, TPOT and TBT per mode; the issue's checks
    (live TTFT p99 ≤ 0.5 × peer-fetch's, live TBT p99 during the scale-up ≤ 1.5 × the steady TBT p99)."""
    from quart_tools.sim.genburst import capacity_sps, gen_stages, run_gen_mode, session_arrivals

    rows, checks, bursts = [], {}, {}
    for model in models:
        mcal = model_calibration(cal, model, fab)
        size, stages, _, _, _, initial = MODELS[model]
        probe, _, _ = session_arrivals(1.0, 1.0, 1.0, 100.0, 100.0, 100.0, seed, trace_path)
        specs = gen_stages(model, size, stages, GEN_KV_BYTES[model], GPU_BYTES, mcal, probe)
        capacity = initial * capacity_sps(specs, probe)
        level = min(burst, PEAK_FRACTION * (mcal.hosts // stages) / initial)
        arrivals, lo, hi = session_arrivals(capacity, base, level, *spans, seed, trace_path)
        bursts[model] = {"initial_replicas": initial, "burst_x_capacity": level, "capacity_sessions_s": capacity,
                         "sessions": len(arrivals)}
        by_mode = {m: run_gen_mode(model, m, specs, mcal, arrivals, (lo, hi), *MODES[m], initial, seed,
                                   PARASERVE_MAX_PARTS) for m in MODES}
        rows.extend(by_mode.values())
        live, peer = by_mode["live"], by_mode["peer-fetch"]
        steady = by_mode["allcache"]["steady_tbt_p99_ms"]
        checks[model] = {
            "live_ttft_p99_over_peer_fetch": _over(live["ttft_p99_ms"], peer["ttft_p99_ms"]), "ttft_target": 0.5,
            "live_tbt_p99_over_steady": _over(live["tbt_p99_ms"], steady), "tbt_target": 1.5,
        }
        checks[model]["met"] = bool(checks[model]["live_ttft_p99_over_peer_fetch"] is not None
                                    and checks[model]["live_ttft_p99_over_peer_fetch"] <= 0.5
                                    and checks[model]["live_tbt_p99_over_steady"] is not None
                                    and checks[model]["live_tbt_p99_over_steady"] <= 1.5)
    return {
        "workload": "generation", "fabric": fab, "gpu_bytes": GPU_BYTES,
        "models": {m: {**dict(zip(("param_bytes", "stages", "layers_per_stage"), MODELS[m][:3], strict=True)),
                       "kv_bytes_per_token": GEN_KV_BYTES[m], **bursts[m]} for m in models},
        "burst": burst_doc(base, burst, spans, seed, "poisson sessions, the trace's lengths"),
        "policy": POLICY,
        "rows": rows,
        "checks": checks,
        "simulated": True,
    }


def _over(a, b) -> float | None:
    return a / b if a is not None and b else None


def plot_blitzscale(doc: dict, out_dir: str | Path, fabric: str = "BlitzScale") -> list[Path]:
    """``blitzscale-<model>.png``: burst mean and p99 latency per mode, and ask → ready per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for model in doc["models"]:
        rows = [r for r in doc["rows"] if r["model"] == model]
        names = [r["mode"] for r in rows]
        x = np.arange(len(rows))
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        gen = doc.get("workload") == "generation"
        left = (("ttft_p50_ms", "burst TTFT p50"), ("ttft_p99_ms", "burst TTFT p99")) if gen else \
            (("burst_mean_ms", "burst mean"), ("burst_p99_ms", "burst p99"))
        right = (("tbt_p99_ms", "TBT p99 (burst + scale-up)"), ("steady_tbt_p99_ms", "TBT p99 before")) if gen else \
            (("ready_ms", "ask → ready (median)"), ("first_served_ms", "ask → first served"))
        for ax, pair in ((a, left), (b, right)):
            for off, (key, label) in zip((-0.2, 0.2), pair, strict=True):
                ax.bar(x + off, [r[key] or 0 for r in rows], 0.4, label=label)
        a.set_yscale("log")
        a.set_ylabel("latency (ms)")
        a.legend()
        b.set_yscale("log")
        b.set_ylabel("ms")
        b.legend()
        for ax in (a, b):
            ax.set_xticks(x, names, rotation=30, ha="right")
        fig.suptitle(f"{model}: one {'generation ' if gen else ''}burst, every start mode (simulated, {fabric} fabric)")
        fig.tight_layout()
        path = out / f"{fabric.lower()}-{'generation-' if gen else ''}{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
