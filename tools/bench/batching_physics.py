"""What one-shot batching can give on this machine, beside what `quartctl bench batching` measures (docs/batching.md).

* :func:`compute_profile`: each stage's compute for a batch of b requests, in this process (``StageRuntime.handle``,
  no HTTP, no router), the requests packed by the router's own ``batching.pack`` (end to end, no padding): of the
  bench's length mix and of one length, and the same b requests one at a time (``alone_ms``, summed) — the ms of
  one call by batch size, min of ``reps``. With ``reference``: transformers' own model (``AutoModel`` of the
  packaged folder, SDPA, padded with an attention mask, the whole model in one call) on the same requests, batched
  and alone. One torch thread: CPU time of this thread (what the call costs a core, robust to the shared machine's
  preemption); more: wall time.
* :func:`theory`: the rates that profile allows. A call of b requests takes S(b) = F + P·b at the slowest stage
  (``gateway_plugin.policies.batch_capacity.fit``); one replica per stage serves at most 1/S(1) req/s one at a time
  and b/S(b) batched; a request waits up to one call and rides the next, so within the SLO only batches with
  2·S(b) + (unloaded − S(1)) ≤ SLO count. Batching can never give more than S(1)/P (all of F shared). For the
  mix, S(1) is its requests' mean time alone (the largest batch's requests, each alone), not its first request's.
* :func:`gain`: measured, not fitted: by batch size, the same b requests alone over batched (the req/s a batch of b
  gives over one at a time), and that gain at the largest profiled batch within the SLO by the same rule.
* :func:`machine_ceiling`: the whole machine's bound: ``cpus`` cores over the CPU ms a request cost (gateway,
  client and stage processes, :class:`CpuMeter`) at the bench's busiest batched row, over the rate reached off.
* :class:`CpuMeter`: CPU seconds of this process (embedded gateway, router, load generator) and of its children
  (stage processes, KeysManager) over a run, per request answered: what a request costs the shared cores.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import psutil

SIZES = (1, 2, 4, 8, 16)


def compute_profile(model_dir: Path, stages: int, threads: int, bodies: dict[int, bytes], mix: list[int],
                    sizes: tuple[int, ...] = SIZES, reps: int = 5, reference: Path | None = None) -> list[dict]:
    """Per batch size: ms per stage of one packed call of ``mix`` lengths (cycled), of their median length, and of
    the same requests alone (summed); with ``reference`` (a Hugging-Face folder) transformers' whole model too."""
    import torch
    from gateway_plugin.batching import member_of, pack
    from quart_stage.config import StageConfig
    from quart_stage.runtime import StageRuntime

    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    runtimes = [StageRuntime.load(StageConfig(model_dir=str(model_dir), stage_index=i, num_stages=stages,
                                              threads=threads, compute="cpu")) for i in range(stages)]
    for rt in runtimes:
        rt.prepare_device()
    headers = {"Content-Type": "application/octet-stream"}
    uniform = int(np.median(mix))
    model = _reference_model(reference) if reference is not None else None

    def call_ms(lengths: list[int]) -> list[float]:
        body = pack([member_of(bodies[n], "") for n in lengths], {})
        best = [float("inf")] * stages
        for _ in range(reps):
            data = body
            for i, rt in enumerate(runtimes):
                t0 = clock()
                resp = rt.handle(data, headers)
                best[i] = min(best[i], 1000 * (clock() - t0))
                if resp.status != 200:
                    raise RuntimeError(f"profile: stage {i} answered {resp.status}: {bytes(resp.body)[:200]!r}")
                data = resp.body
        return best

    def reference_ms(lengths: list[int]) -> float:
        ids = torch.zeros((len(lengths), max(lengths)), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            ids[row, :n] = member_of(bodies[n], "").tensors["input_ids"][0]
            mask[row, :n] = 1
        best = float("inf")
        with torch.inference_mode():
            for _ in range(reps):
                t0 = clock()
                model(input_ids=ids, attention_mask=mask)
                best = min(best, 1000 * (clock() - t0))
        return best

    call_ms([uniform])  # warm-up
    alone = {n: call_ms([n]) for n in sorted(set(mix))}
    ref_alone = {n: reference_ms([n]) for n in sorted(set(mix))} if model is not None else {}
    rows = []
    for b in sizes:
        lengths = [mix[k % len(mix)] for k in range(b)]
        row = {"size": b, "mixed_ms": _r(call_ms(lengths)), "uniform_ms": _r(call_ms([uniform] * b)),
               "alone_ms": _r([sum(alone[n][i] for n in lengths) for i in range(stages)]),
               "tokens": sum(lengths), "uniform_tokens": b * uniform}
        if model is not None:
            row["transformers_ms"] = _r([reference_ms(lengths)])
            row["transformers_alone_ms"] = _r([sum(ref_alone[n] for n in lengths)])
        rows.append(row)
    return rows


def _r(values: list[float]) -> list[float]:
    return [round(x, 2) for x in values]


def _reference_model(folder: Path):
    """transformers' own encoder of a Hugging-Face (sentence-transformers) folder, SDPA attention, eval mode."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(folder), attn_implementation="sdpa").eval()


def theory(profile: list[dict], key: str, slo_ms: float, unloaded_ms: float, batch_max: int) -> dict:
    """Max rates within the SLO the ``key`` ("mixed_ms" / "uniform_ms") profile allows at the slowest stage."""
    from gateway_plugin.policies.batch_capacity import fit

    bottleneck = max(range(len(profile[0][key])), key=lambda i: profile[-1][key][i])
    table = [(r["size"], 1, r[key][bottleneck] / 1000) for r in profile]
    if key == "mixed_ms" and "alone_ms" in profile[-1] and profile[0]["size"] == 1:
        # one request of the mix alone on average (the largest batch's requests alone / its size), not the mix's
        # first request: a fit through one long request would overstate S(1), hence every ratio
        last = profile[-1]
        table[0] = (1, 1, last["alone_ms"][bottleneck] / last["size"] / 1000)
    p = fit(tuple(table), batch_max)
    one = table[0][2] if table[0][0] == 1 else p.service_s(1)  # measured alone, else the fit's
    rest_s = max(0.0, unloaded_ms / 1000 - one)
    fits = [b for b in range(1, batch_max + 1) if 2 * p.service_s(b) + rest_s <= slo_ms / 1000]
    best = max(fits, default=1)
    off, on = 1 / one, p.rate(best)
    return {"stage": bottleneck, "fixed_ms": round(1000 * p.fixed_s, 2), "per_request_ms": round(1000 * p.per_request_s, 2),
            "max_rate_off": round(off, 1), "batch_within_slo": best, "max_rate_on": round(on, 1),
            "ratio": round(on / off, 2), "ratio_at_any_batch": round(one / p.per_request_s, 2)}


def gain(profile: list[dict], batched: str, alone: str, slo_ms: float, unloaded_ms: float) -> dict:
    """Measured batching gain at the slowest stage of ``batched`` (e.g. "mixed_ms" with "alone_ms"): by batch size the
    same requests' time alone over their time as one call; the largest profiled size within the SLO (2·S(b) + the
    unloaded latency's other parts ≤ SLO, as :func:`theory`) and its gain."""
    stage = max(range(len(profile[-1][batched])), key=lambda i: profile[-1][batched][i])
    by_size = {r["size"]: round(r[alone][stage] / r[batched][stage], 2) for r in profile}
    one = profile[0][alone][stage] / profile[0]["size"]
    rest = max(0.0, unloaded_ms - one)
    fits = [r["size"] for r in profile if 2 * r[batched][stage] + rest <= slo_ms]
    best = max(fits, default=profile[0]["size"])
    return {"stage": stage, "by_size": by_size, "batch_within_slo": best, "ratio_within_slo": by_size[best],
            "ratio_at_largest": by_size[profile[-1]["size"]]}


def machine_ceiling(rows: list[dict], cpus: int, rate_off: float) -> dict:
    """The rate the whole machine's ``cpus`` cores allow at the CPU a request cost in the busiest batched row (all of
    the machine this bench's, nobody else's), and that over the max rate reached without batching."""
    busy = [r for r in rows if r["batching"] == "on" and r.get("cpu_ms_per_request")]
    if not busy:
        return {}
    row = max(busy, key=lambda r: r["rate"])
    cost = row["cpu_ms_per_request"]
    per_request = sum(cost.values())
    ceiling = 1000 * cpus / per_request if per_request > 0 else float("inf")
    return {"rate": row["rate"], "cpu_ms_per_request": round(per_request, 2), **{f"cpu_ms_{k}": v for k, v in cost.items()},
            "cpus": cpus, "ceiling_rate": round(ceiling, 1),
            "ceiling_over_off": round(ceiling / rate_off, 2) if rate_off > 0 else None}


class CpuMeter:
    """CPU seconds of this process and of its live children since :meth:`start` (children that exit are not counted;
    each child's time is taken against its own mark, so one that exits in between does not make the sum negative)."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.mark: tuple[float, dict[int, float]] = (0.0, {})

    def _now(self) -> tuple[float, dict[int, float]]:
        mine = self.me.cpu_times()
        kids: dict[int, float] = {}
        for child in self.me.children(recursive=True):
            try:
                t = child.cpu_times()
                kids[child.pid] = t.user + t.system
            except psutil.Error:
                pass
        return mine.user + mine.system, kids

    def start(self) -> None:
        self.mark = self._now()

    def per_request_ms(self, requests: int) -> dict[str, float]:
        """{"gateway_client", "stages"}: CPU ms per request since :meth:`start`."""
        now = self._now()
        n = max(1, requests)
        kids = sum(max(0.0, t - self.mark[1].get(pid, 0.0)) for pid, t in now[1].items())
        return {"gateway_client": round(1000 * (now[0] - self.mark[0]) / n, 2),
                "stages": round(1000 * kids / n, 2)}
