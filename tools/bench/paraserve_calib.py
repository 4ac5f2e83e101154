"""What `quartctl bench paraserve` reads from a run (both workloads): each worker's timeline (its KeysManager's
part-start marks and the gateway's), the part each host started with, and the planner's calibration from them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from quart_kernel.scheduling.paraserve import ParaServeCosts, largest_part, predict
from quart_tools.bench.blitz import PeerCluster

FUNCTION = "paraserve-stage-0"


def part_bytes(paraserve) -> dict[str, int]:
    """Host → the bytes of the part it started with, in the first ParaServe group (none for P = 1)."""
    if not paraserve.history:
        return {}
    group = paraserve.history[0]
    layout = paraserve.layouts[group.function][1]
    return {h: sum(layout.layer_bytes[a - layout.start:b - layout.start]) for h, (a, b) in zip(
        group.hosts, group.parts, strict=True)}


async def worker_timelines(cluster: PeerCluster, hosts: list[str], t0_wall: float, seen: dict[str, dict[str, float]],
                           parts: dict[str, int]) -> dict[str, dict]:
    """Per host that started a replica: its KeysManager's part-start marks (``PartJob.marks``: requested,
    fetch_begin, first_layer, part_held, zygote_built, forked, whole; a whole-stage start: fetch_begin, whole)
    and the gateway's (answered, routable, whole_routable), ms from the cold start; ``part_bytes``."""
    out: dict[str, dict] = {}
    for h in hosts:
        status = await asyncio.to_thread(cluster.client(h).stage, FUNCTION)
        marks = dict(status.get("timeline") or {})
        if "finished_at" in status:  # the fetch's end and length (a part start's own marks come first)
            marks.setdefault("fetch_begin", status["finished_at"] - status["seconds"])
            marks.setdefault("whole", status["finished_at"])
        marks = {k: round(1000 * (v - t0_wall), 1) for k, v in marks.items()}
        if marks or h in seen:
            out[h] = dict(sorted({**marks, **seen.get(h, {})}.items(), key=lambda kv: kv[1]))
            if h in parts:
                out[h]["part_bytes"] = parts[h]
    return out


@dataclass(frozen=True)
class Calibration:
    """What the planner is told for the SLO run, measured in this run's rows (seconds, bytes/s)."""

    fetch_bytes_s: float  # the slowest worker's part fetch rate (its NIC, its share of the registry and CPU)
    fixed_s: float  # the slowest worker's start besides its fetch (asked → routable), overlapped with it
    tail_s: float  # the largest (first answer − predicted fetch) over the rows: no row is predicted optimistic

    def costs(self, registry_bytes_s: float) -> ParaServeCosts:
        return ParaServeCosts(registry_bytes_s=registry_bytes_s, fixed_s=self.fixed_s, overlap=True,
                              tail_s=self.tail_s)


def calibrate(rows: list[dict], stage_bytes: int) -> Calibration:
    """Per-phase figures from the rows' worker timelines (``workers``: ms marks and ``part_bytes``): the fetch
    rate is the slowest worker's (part bytes / (part_held − fetch_begin); a whole-stage start: stage bytes /
    (whole − fetch_begin)), the fixed cost the slowest worker's requested → routable, and the tail what each
    row's first answer took beyond the model's ``max(fixed, part / rate)``, its largest over the rows."""
    rates, fixed = [], 0.0
    for row in rows:
        for w in row["workers"].values():
            end = w.get("part_held", w.get("whole"))
            if end is not None and "fetch_begin" in w and end > w["fetch_begin"]:
                rates.append(w.get("part_bytes", stage_bytes) / ((end - w["fetch_begin"]) / 1000))
            if row["P"] > 1 and "routable" in w and "requested" in w:
                fixed = max(fixed, (w["routable"] - w["requested"]) / 1000)
    if not rates:
        raise RuntimeError("no worker timeline to calibrate the planner from")
    rate = min(rates)

    def largest(row: dict) -> float:  # the row's largest part as fetched (layers seldom split evenly)
        return max((w.get("part_bytes", stage_bytes) for w in row["workers"].values()), default=stage_bytes)

    tail = max(0.0, *(row["first_served_ms"] / 1000 - max(fixed, largest(row) / rate) for row in rows
                      if row["first_served_ms"] is not None))
    return Calibration(rate, fixed, tail)


def predictions(cal: Calibration, layer_bytes: list[int], registry_bytes_s: float, max_parts: int
                ) -> dict[int, float]:
    """The planner's predicted first answer (ms) for each P with this calibration (``predict`` of the largest
    part, as `plan_parallelism` does)."""
    costs, stage_bytes = cal.costs(registry_bytes_s), sum(layer_bytes)
    return {p: round(1000 * predict(stage_bytes, [min(cal.fetch_bytes_s, registry_bytes_s / p)] * p, costs,
                                    largest_part(layer_bytes, p))[0], 1) for p in range(1, max_parts + 1)}
