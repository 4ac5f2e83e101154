"""`quartctl simulate --experiment paraserve`: a generation burst on ParaServe's fabric, its pipelined cold start
beside AllCache and a plain cold start, judged on TTFT and TPOT SLO attainment (issue 29, "Simulator").

Fabric (ParaServe §8.1, testbed (i), one GPU per simulated host): 8 servers with one 24 GB GPU each (A10), 16
Gbit/s of network per server, and remote storage whose fetch rate is bound only by the servers' network (each
host fetches at 16 Gbit/s; the storage's total is the servers' sum). PCIe host → GPU at 128 Gbit/s
(assumption). Models: Llama-2-7B (one stage) and Llama-2-13B (26 GB: two stages of 13 GB, as it cannot sit on
one 24 GB GPU). SLOs by ParaServe's rule (TTFT 5 × warm, TPOT 2 × warm; `quart_tools.sim.genmodels`). The same
sessions for every mode; ParaServe's P is the live planner's (`plan_parallelism`, at most 4 as in §8) for the
TTFT SLO; when a group consolidates, its helpers' sessions move to the kept worker with their KV caches, no
re-prefill (``kv_migrations``).
"""

from __future__ import annotations

from dataclasses import replace

from quart_tools.sim.blitzscale import POLICY, burst_doc
from quart_tools.sim.calibration import Calibration
from quart_tools.sim.genburst import capacity_sps, gen_stages, run_gen_mode, session_arrivals

FABRIC = {"hosts": 8, "gpus_per_host": 1, "gpu_bytes": 24e9, "nic_gbit_s": 16.0, "storage_gbit_s": 16.0,
          "h2d_gbit_s": 128.0}
# name → (parameter bytes, stages, KV bytes per position (fp16 K and V: layers × KV heads × 128 × 2 × 2), layers)
MODELS: dict[str, tuple[float, int, int, int]] = {
    "llama2-7b": (13.5e9, 1, 2 * 32 * 32 * 128 * 2, 32),
    "llama2-13b": (26.0e9, 2, 2 * 40 * 40 * 128 * 2, 20),
}
MODES: dict[str, tuple[frozenset[str], bool]] = {  # mode → (start mechanisms, every host caches every stage)
    "allcache": (frozenset(), True),
    "registry-cold": (frozenset(), False),
    "paraserve": (frozenset({"paraserve"}), False),
}
MAX_PARTS = 4
INITIAL = 1  # replicas per stage before the burst


def fabric_calibration(base: Calibration, model: str) -> Calibration:
    fab = FABRIC
    src = dict(base.sources)
    src.update({
        "nic_gbytes_s": "ParaServe §8.1 testbed (i): 16 Gbit/s per server",
        "disk_gbps": "ParaServe §8.1: fetching is bound by the server's 16 Gbit/s network",
        "registry_gbytes_s": "ParaServe §8.1: the remote storage has sufficient network capacity (8 × 16 Gbit/s)",
        "h2d_gbps": "assumption: 128 Gbit/s PCIe host → GPU",
        "hosts": "ParaServe §8.1 testbed (i): 8 GPU servers; one simulated host per GPU",
        "live_layers": f"{model}: layers per stage",
    })
    return replace(base, hosts=fab["hosts"], gpus_per_host=fab["gpus_per_host"], nic_gbytes_s=fab["nic_gbit_s"] / 8,
                   disk_gbps=fab["storage_gbit_s"] / 8, registry_gbytes_s=fab["hosts"] * fab["nic_gbit_s"] / 8,
                   h2d_gbps=fab["h2d_gbit_s"] / 8, live_layers=MODELS[model][3], service_cv=0.1, sources=src)


def run_paraserve(models: list[str], cal: Calibration, trace_path: str, seed: int = 0, base: float = 0.5,
                  burst: float = 3.0, warm_s: float = 30.0, burst_s: float = 30.0, cool_s: float = 60.0) -> dict:
    rows, checks, info = [], {}, {}
    for model in models:
        if model not in MODELS:
            raise ValueError(f"models: unknown {model!r}; one of {', '.join(MODELS)}")
        size, stages, kv, _ = MODELS[model]
        mcal = fabric_calibration(cal, model)
        probe, _, _ = session_arrivals(1.0, 1.0, 1.0, 100.0, 100.0, 100.0, seed, trace_path)
        specs = gen_stages(model, size, stages, kv, FABRIC["gpu_bytes"], mcal, probe)
        capacity = INITIAL * capacity_sps(specs, probe)
        level = min(burst, 0.75 * (mcal.hosts // stages) / INITIAL)
        arrivals, lo, hi = session_arrivals(capacity, base, level, warm_s, burst_s, cool_s, seed, trace_path)
        info[model] = {"param_bytes": size, "stages": stages, "kv_bytes_per_token": kv, "capacity_sessions_s": capacity,
                       "burst_x_capacity": level, "sessions": len(arrivals)}
        by_mode = {m: run_gen_mode(model, m, specs, mcal, arrivals, (lo, hi), *MODES[m], INITIAL, seed, MAX_PARTS)
                   for m in MODES}
        rows.extend(by_mode.values())
        cold, para = by_mode["registry-cold"], by_mode["paraserve"]
        checks[model] = {
            "ttft_p50_cold_over_paraserve": cold["ttft_p50_ms"] / para["ttft_p50_ms"] if para["ttft_p50_ms"] else None,
            "ttft_attainment_paraserve_over_cold": (para["ttft_slo_attainment"] / cold["ttft_slo_attainment"]
                                                    if cold["ttft_slo_attainment"] else None),
            "paper": "ParaServe: TTFT up to 4.7× lower, TTFT SLO attainment up to 1.74× (§8.2, §8.3)",
        }
    return {"fabric": FABRIC, "models": info,
            "burst": burst_doc(base, burst, (warm_s, burst_s, cool_s), seed, "poisson sessions, the trace's lengths"),
            "policy": POLICY, "rows": rows, "checks": checks, "simulated": True}
