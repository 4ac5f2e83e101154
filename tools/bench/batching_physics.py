"""What one-shot batching can give on this machine, beside what `quartctl bench batching` measures (docs/batching.md).

* :func:`compute_profile`: each stage's compute for a batch of b requests, in this process (``StageRuntime.handle``,
  no HTTP, no router), the requests packed by the router's own ``batching.pack`` (end to end, no padding): of the
  bench's length mix and of one length — the ms of one call by batch size, min of ``reps``.
* :func:`theory`: the rates that profile allows. A call of b requests takes S(b) = F + P·b at the slowest stage
  (``gateway_plugin.policies.batch_capacity.fit``); one replica per stage serves at most 1/S(1) req/s one at a time
  and b/S(b) batched; a request waits up to one call and rides the next, so within the SLO only batches with
  2·S(b) + (unloaded − S(1)) ≤ SLO count. Batching can never give more than S(1)/P (all of F shared).
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
                    sizes: tuple[int, ...] = SIZES, reps: int = 5) -> list[dict]:
    """Per batch size: ms per stage of one packed call, of ``mix`` lengths (cycled) and of their median length."""
    import torch
    from gateway_plugin.batching import member_of, pack
    from quart_stage.config import StageConfig
    from quart_stage.runtime import StageRuntime

    torch.set_num_threads(threads)
    runtimes = [StageRuntime.load(StageConfig(model_dir=str(model_dir), stage_index=i, num_stages=stages,
                                              threads=threads, compute="cpu")) for i in range(stages)]
    for rt in runtimes:
        rt.prepare_device()
    headers = {"Content-Type": "application/octet-stream"}
    uniform = int(np.median(mix))

    def call_ms(lengths: list[int]) -> list[float]:
        body = pack([member_of(bodies[n], "") for n in lengths], {})
        best = [float("inf")] * stages
        for _ in range(reps):
            data = body
            for i, rt in enumerate(runtimes):
                t0 = time.perf_counter()
                resp = rt.handle(data, headers)
                best[i] = min(best[i], 1000 * (time.perf_counter() - t0))
                if resp.status != 200:
                    raise RuntimeError(f"profile: stage {i} answered {resp.status}: {bytes(resp.body)[:200]!r}")
                data = resp.body
        return [round(x, 2) for x in best]

    call_ms([uniform])  # warm-up
    rows = []
    for b in sizes:
        lengths = [mix[k % len(mix)] for k in range(b)]
        rows.append({"size": b, "mixed_ms": call_ms(lengths), "uniform_ms": call_ms([uniform] * b),
                     "tokens": sum(lengths), "uniform_tokens": b * uniform})
    return rows


def theory(profile: list[dict], key: str, slo_ms: float, unloaded_ms: float, batch_max: int) -> dict:
    """Max rates within the SLO the ``key`` ("mixed_ms" / "uniform_ms") profile allows at the slowest stage."""
    from gateway_plugin.policies.batch_capacity import fit

    bottleneck = max(range(len(profile[0][key])), key=lambda i: profile[-1][key][i])
    table = tuple((r["size"], 1, r[key][bottleneck] / 1000) for r in profile)
    p = fit(table, batch_max)
    one = p.service_s(1)
    rest_s = max(0.0, unloaded_ms / 1000 - one)
    fits = [b for b in range(1, batch_max + 1) if 2 * p.service_s(b) + rest_s <= slo_ms / 1000]
    best = max(fits, default=1)
    off, on = 1 / one, p.rate(best)
    return {"stage": bottleneck, "fixed_ms": round(1000 * p.fixed_s, 2), "per_request_ms": round(1000 * p.per_request_s, 2),
            "max_rate_off": round(off, 1), "batch_within_slo": best, "max_rate_on": round(on, 1),
            "ratio": round(on / off, 2), "ratio_at_any_batch": round(one / p.per_request_s, 2)}


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
