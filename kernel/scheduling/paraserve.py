"""ParaServe planning (ParaServe §4): how many hosts share one cold stage's fetch, and which. Pure.

A cold stage of ``stage_bytes`` split over P hosts: each host fetches 1/P of the bytes from the registry at
its own NIC rate (the registry's bandwidth is shared by the P fetchers), copies its part host → device, and
the P parts serve as a sub-pipeline at once (one extra hop per part after the first). The planner picks the
smallest P whose predicted first response meets the SLO, among hosts whose NICs carry no serving traffic
and no other cold fetch first (the ``Link`` / busy-link notion of `quart_kernel.scheduling.multicast`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from quart_kernel.scheduling.multicast import Link


@dataclass(frozen=True, slots=True)
class FetchHost:
    """One candidate host: its NIC rate (bytes/s) and the cold fetches already running through that NIC."""

    name: str
    nic_bytes_s: float
    fetching: int = 0  # cold-start fetches in progress on this NIC (they share it equally)


@dataclass(frozen=True, slots=True)
class ParaServeCosts:
    """What a prediction needs besides the hosts (measured or calibrated; seconds, bytes/s)."""

    registry_bytes_s: float  # the registry's total bandwidth, shared by the P fetchers
    h2d_bytes_s: float = math.inf  # host → device copy rate (inf: no copy, e.g. CPU stages)
    fixed_s: float = 0.0  # process / runtime start of a worker (not overlapped with the fetch here)
    hop_s: float = 0.001  # per-hop latency between two parts of the sub-pipeline
    service_s: float = 0.0  # the stage's whole compute time for one request
    busy_share: float = 0.5  # fraction of a busy NIC's rate left for the fetch
    overlap: bool = False  # the fetch runs while the worker starts (ParaServe §5): max(fixed, fetch), not the sum
    tail_s: float = 0.0  # after the slowest part's last byte until the first answer (ask lag, notice, retries)


@dataclass(frozen=True, slots=True)
class ParaServePlan:
    """The chosen split: hosts in part order, the predicted first response and when it was feasible."""

    parts: int
    hosts: tuple[str, ...]
    first_response_s: float
    fetch_s: float  # the slowest part's fetch + copy (the sub-pipeline serves after it)
    consolidated_s: float  # every worker holds the whole stage (background fetch of the rest)
    meets_slo: bool


def host_rate(host: FetchHost, busy: bool, costs: ParaServeCosts, parts: int) -> float:
    """Bytes/s one part's fetch gets on ``host``: its NIC share, capped by its share of the registry."""
    nic = host.nic_bytes_s / (1 + max(0, host.fetching))
    if busy:
        nic *= costs.busy_share
    return min(nic, costs.registry_bytes_s / max(1, parts))


def predict(stage_bytes: int, rates: Sequence[float], costs: ParaServeCosts,
            part_bytes: float | None = None) -> tuple[float, float, float]:
    """(first response, fetch, consolidated) seconds from the cold start for parts fetched at ``rates``.
    ``part_bytes``: the largest part's bytes (layers seldom split evenly); default an even split."""
    parts = len(rates)
    if parts < 1:
        raise ValueError("rates: at least one host")
    part = stage_bytes / parts if part_bytes is None else part_bytes
    slowest = min(rates)
    if slowest <= 0:
        return math.inf, math.inf, math.inf
    fixed_and_fetch = max(costs.fixed_s, part / slowest) if costs.overlap else costs.fixed_s + part / slowest
    fetch = fixed_and_fetch + part / costs.h2d_bytes_s
    first = fetch + costs.service_s + (parts - 1) * costs.hop_s + costs.tail_s
    rest = stage_bytes - part
    consolidated = fetch + rest / slowest + rest / costs.h2d_bytes_s
    return first, fetch, consolidated


def busy_receivers(busy_links: Collection[Link]) -> frozenset[str]:
    """Hosts whose incoming NIC direction carries serving traffic (a fetch competes with it)."""
    return frozenset(b for _, b in busy_links)


def rank_hosts(hosts: Sequence[FetchHost], busy_links: Collection[Link] = frozenset()) -> list[FetchHost]:
    """Quiet NICs first (no serving traffic in, fewest cold fetches), then the fastest, then the name."""
    busy = busy_receivers(busy_links)
    return sorted(hosts, key=lambda h: (h.name in busy, h.fetching, -h.nic_bytes_s, h.name))


def plan_parallelism(stage_bytes: int, slo_s: float, hosts: Sequence[FetchHost], costs: ParaServeCosts,
                     busy_links: Collection[Link] = frozenset(), max_parts: int = 8,
                     layer_bytes: Sequence[int] | None = None) -> ParaServePlan:
    """The smallest P (1 ≤ P ≤ min(max_parts, distinct hosts)) whose predicted first response ≤ ``slo_s``.

    Workers go to the best-ranked hosts (`rank_hosts`), one per host. ``layer_bytes``: the stage's layers, so
    each P is predicted from its largest part (`largest_part`) rather than an even split. When no P meets the
    SLO the plan with the earliest first response is returned with ``meets_slo=False`` (the caller may still
    use it).
    """
    if stage_bytes < 0:
        raise ValueError(f"stage_bytes: must be ≥ 0, got {stage_bytes}")
    if max_parts < 1:
        raise ValueError(f"max_parts: must be ≥ 1, got {max_parts}")
    unique: dict[str, FetchHost] = {}
    for h in hosts:
        unique.setdefault(h.name, h)
    if not unique:
        raise ValueError("hosts: no host to fetch on")
    ranked = rank_hosts(list(unique.values()), busy_links)
    busy = busy_receivers(busy_links)
    best: ParaServePlan | None = None
    for parts in range(1, min(max_parts, len(ranked)) + 1):
        plan = _plan_for(parts, ranked, busy, stage_bytes, slo_s, costs, layer_bytes)
        if plan.meets_slo:
            return plan
        if best is None or plan.first_response_s < best.first_response_s:
            best = plan
    assert best is not None
    return best


def _plan_for(parts: int, ranked: Sequence[FetchHost], busy: Collection[str], stage_bytes: int, slo_s: float,
              costs: ParaServeCosts, layer_bytes: Sequence[int] | None) -> ParaServePlan:
    """The plan of exactly ``parts`` workers on the first ``parts`` of ``ranked``."""
    chosen = ranked[:parts]
    rates = [host_rate(h, h.name in busy, costs, parts) for h in chosen]
    biggest = largest_part(layer_bytes, parts) if layer_bytes else None
    first, fetch, consolidated = predict(stage_bytes, rates, costs, biggest)
    return ParaServePlan(parts, tuple(h.name for h in chosen), first, fetch, consolidated, first <= slo_s)


def parts_limit(max_parts: int, layer_bytes: Sequence[int] | None, hosts: Sequence[FetchHost]) -> int:
    """The largest P a cold stage may take: ``max_parts``, its layers (when known), the hosts able to take a
    part; at least 1."""
    return max(1, min(max_parts, len(layer_bytes) if layer_bytes else max_parts, len(hosts)))


def choose_parts(stage_bytes: int, slo_s: float, hosts: Sequence[FetchHost], costs: ParaServeCosts,
                 max_parts: int = 8, layer_bytes: Sequence[int] | None = None, fixed_parts: int = 0) -> ParaServePlan:
    """ParaServe's P for one cold stage, the rule the gateway and the simulator share: P is at most
    ``max_parts``, the stage's layers (when ``layer_bytes`` is known) and the hosts able to take a part
    (``hosts``: those with a free GPU slot, at least one); ``fixed_parts`` (> 0) forces P within that limit,
    otherwise the smallest P meeting ``slo_s`` (`plan_parallelism`)."""
    limit = parts_limit(max_parts, layer_bytes, hosts)
    if fixed_parts > 0:
        ranked = rank_hosts(list({h.name: h for h in hosts}.values()))
        if not ranked:  # nowhere to fetch yet: P alone (the placer finds the hosts)
            return ParaServePlan(min(fixed_parts, limit), (), math.inf, math.inf, math.inf, False)
        return _plan_for(min(fixed_parts, limit, len(ranked)), ranked, frozenset(), stage_bytes, slo_s, costs,
                         layer_bytes)
    return plan_parallelism(stage_bytes, slo_s, hosts, costs, max_parts=limit, layer_bytes=layer_bytes)


def hosts_from_rates(nic_bytes_s: Mapping[str, float], fetching: Mapping[str, int] | None = None) -> list[FetchHost]:
    """`FetchHost`s from measured NIC rates per host (and running cold fetches per host)."""
    fetching = fetching or {}
    return [FetchHost(name, rate, fetching.get(name, 0)) for name, rate in sorted(nic_bytes_s.items())]


def largest_part(layer_bytes: Sequence[int], parts: int) -> int:
    """The bytes of the largest of `split_parts`'s ``parts`` parts (what the slowest worker fetches)."""
    return max(sum(layer_bytes[a:b]) for a, b in split_parts(layer_bytes, parts))


def split_parts(layer_bytes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, non-empty ranges ``[a, b)`` of the layers (relative indices) tiling them, chosen so
    the largest part's bytes are as small as possible (each worker's fetch, ParaServe §4.1), then the parts as
    even as possible (sum of squares). ``parts`` is capped at the number of layers."""
    n = len(layer_bytes)
    if n == 0:
        raise ValueError("layer_bytes: no layers to split")
    if parts < 1:
        raise ValueError(f"parts: must be ≥ 1, got {parts}")
    parts = min(parts, n)
    prefix = [0]
    for size in layer_bytes:
        if size < 0:
            raise ValueError("layer_bytes: sizes must be ≥ 0")
        prefix.append(prefix[-1] + size)
    # best[k][j]: (largest part, sum of squares) for the first j layers in k parts (linear partition, O(P·n²))
    worst = (math.inf, math.inf)
    best = [[worst] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0, 0)
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                size = prefix[j] - prefix[i]
                cost = (max(best[k - 1][i][0], size), best[k - 1][i][1] + size * size)
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds, j = [n], n
    for k in range(parts, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds.reverse()
    return list(zip(bounds, bounds[1:], strict=False))
