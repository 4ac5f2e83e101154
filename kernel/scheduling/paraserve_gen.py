"""ParaServe for generation (ParaServe §4 and §6.1, issue 29): P from TTFT and TPOT SLOs, and how many workers a
group keeps when it consolidates. Pure.

A group of P parts answers a session's first token after its slowest part's fetch (`paraserve.predict`, as for a
one-shot pass) plus the prefill, which runs the parts in order: the whole stage's prefill time plus one hop per
extra part. Each decode step passes through the P parts too: the whole stage's decode time plus P − 1 hops. So a
larger P starts sooner but decodes slower until the group consolidates. `plan_generation` picks, among the P
whose predicted TPOT meets its SLO, the smallest whose predicted TTFT meets its SLO (else the one with the
earliest TTFT; else, when no P meets the TPOT SLO, P = 1's plan, flagged).

Consolidation (§6.1): by default the group scales down to one whole worker (the sessions' KV caches migrate to
it). Under a burst it scales up instead — the group becomes several whole workers — by the paper's sliding
window: the requests that arrived in the last window predict the most that may arrive in the next; the workers
to keep serve those plus the ones waiting now (`workers_to_keep`); once a group is whole, the gateway raises the
function's desired count to that many (`desired_after_consolidation`) and the one convergence keeps them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from quart_kernel.scheduling.paraserve import (
    FetchHost,
    ParaServeCosts,
    host_rate,
    largest_part,
    predict,
    rank_hosts,
)


@dataclass(frozen=True, slots=True)
class GenerationCosts:
    """Per-step compute of the whole stage and the cost of one extra part (seconds), from the calibration."""

    prefill_s_per_token: float  # the whole stage's prefill time per prompt token
    decode_s: float  # the whole stage's decode step (one position)
    hop_s: float  # one extra part on a step's path (network, HTTP, (de)serialising the activation)
    prefill_min_s: float = 0.0  # a prefill costs at least this (a short prompt is bound by the weight read)

    def prefill_s(self, prompt_tokens: int) -> float:
        return max(self.prefill_min_s, prompt_tokens * self.prefill_s_per_token)


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """The chosen P, its hosts, and what it is predicted to give."""

    parts: int
    hosts: tuple[str, ...]
    ttft_s: float  # a session arriving at the cold start: the first token
    tpot_s: float  # a decode step while the group serves in parts
    meets_ttft: bool
    meets_tpot: bool


def predict_generation(first_response_s: float, parts: int, prompt_tokens: int, gen: GenerationCosts
                       ) -> tuple[float, float]:
    """(TTFT, TPOT) of a session arriving at the cold start of a P-part group whose sub-pipeline first serves
    at ``first_response_s`` (the fetch prediction, no compute)."""
    hops = (parts - 1) * gen.hop_s
    return first_response_s + gen.prefill_s(prompt_tokens) + hops, gen.decode_s + hops


def plan_generation(stage_bytes: int, ttft_slo_s: float, tpot_slo_s: float, hosts: Sequence[FetchHost],
                    costs: ParaServeCosts, gen: GenerationCosts, prompt_tokens: int, max_parts: int = 8,
                    layer_bytes: Sequence[int] | None = None) -> GenerationPlan:
    """P for a cold decoder stage from both SLOs (module docstring); ``costs.service_s`` is ignored (the
    compute is ``gen``'s)."""
    if stage_bytes < 0 or prompt_tokens < 1 or max_parts < 1:
        raise ValueError("stage_bytes ≥ 0, prompt_tokens ≥ 1 and max_parts ≥ 1 are required")
    unique = {h.name: h for h in reversed(list(hosts))}
    if not unique:
        raise ValueError("hosts: no host to fetch on")
    ranked = rank_hosts(list(unique.values()))
    fetch_only = ParaServeCosts(costs.registry_bytes_s, costs.h2d_bytes_s, costs.fixed_s, 0.0, 0.0,
                                costs.busy_share, costs.overlap, costs.tail_s)
    plans = []
    for parts in range(1, min(max_parts, len(ranked)) + 1):
        chosen = ranked[:parts]
        rates = [host_rate(h, False, fetch_only, parts) for h in chosen]
        first = predict(stage_bytes, rates, fetch_only, largest_part(layer_bytes, parts) if layer_bytes else None)[0]
        ttft, tpot = predict_generation(first, parts, prompt_tokens, gen)
        plans.append(GenerationPlan(parts, tuple(h.name for h in chosen), ttft, tpot, ttft <= ttft_slo_s,
                                    tpot <= tpot_slo_s))
    decodable = [p for p in plans if p.meets_tpot]
    if not decodable:
        return plans[0]
    return next((p for p in decodable if p.meets_ttft), min(decodable, key=lambda p: (p.ttft_s, p.parts)))


def workers_to_keep(arrivals: Sequence[float], now: float, window_s: float, waiting: int, per_worker: int,
                    group_size: int) -> int:
    """How many of a consolidating group's ``group_size`` workers stay as whole workers (1: scale down, the
    others leave; more: scale up). ``arrivals``: request arrival times of the model; those in the last
    ``window_s`` predict the next window's; with the ``waiting`` ones they need ``per_worker`` sessions each."""
    if window_s <= 0 or per_worker < 1 or group_size < 1:
        raise ValueError("window_s > 0, per_worker ≥ 1 and group_size ≥ 1 are required")
    predicted = sum(1 for t in arrivals if now - window_s < t <= now)
    return max(1, min(group_size, math.ceil((waiting + predicted) / per_worker)))


@dataclass(frozen=True, slots=True)
class GroupDemand:
    """What the sliding-window rule reads of a model's sessions (the gateway's session engine reports it)."""

    arrivals: tuple[float, ...] = ()  # session arrival times (monotonic)
    waiting: int = 0  # sessions waiting for a replica now
    per_worker: int = 1  # sessions one whole worker holds


def desired_after_consolidation(desired: int, demand: GroupDemand, now: float, window_s: float, group_size: int
                                ) -> int:
    """The desired count once a group of ``group_size`` workers is whole: at least the workers the sliding window
    keeps (`workers_to_keep`; the others leave by the surplus rule), never below what was desired already."""
    keep = workers_to_keep(demand.arrivals, now, window_s, demand.waiting, demand.per_worker, group_size)
    return max(desired, keep)
