"""The placers: cache-blind first-fit (baseline) and QUART's cache-aware placer (§6.2). Pure."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from quart_kernel.scheduling.cluster import Batch, HostState, fair_trim, merge_requests
from quart_kernel.scheduling.config import SchedulerConfig
from quart_kernel.scheduling.dispersion import DispersionProblem, disperse, round_expected
from quart_kernel.scheduling.types import HostView, ReplicaRequest, ScheduleResult

SOURCE_COST = {"fork": 0.0, "peer": 0.5, "cold": 1.0}  # a peer fetch costs a network transfer, no registry


def _states(hosts: list[HostView]) -> list[HostState]:
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"host names must be unique, got {names}")
    held = frozenset().union(*(h.cached | h.held for h in hosts))  # a zygote, or the stage's file, to fetch from
    return [HostState.of(h, i, held) for i, h in enumerate(hosts)]


def contention(hosts: list[HostView], requests: list[ReplicaRequest]) -> float:
    """Requested replicas / free GPU slots over all hosts (∞ when nothing is free but something is asked)."""
    asked = sum(max(0, r.count) for r in requests)
    free = sum(h.gpu_free for h in hosts)
    if free == 0:
        return float("inf") if asked else 0.0
    return asked / free


class FirstFitPlacer:
    """Cache-blind baseline: every replica to the first host in list order with a free slot."""

    name = "first-fit"

    def place(
        self,
        hosts: list[HostView],
        requests: list[ReplicaRequest],
        key_history: dict[str, int] | None = None,
    ) -> ScheduleResult:
        states = _states(hosts)
        merged = merge_requests(requests)
        batch = Batch()
        for req in merged:
            key = req.key or (key_history or {}).get(req.function, 0) > 0
            for _ in range(req.count):
                host = next((h for h in states if h.fits(req)), None)
                if host is None:
                    batch.missing[req.function] = batch.missing.get(req.function, 0) + 1
                else:
                    batch.placements.append(host.take(req, key))
        return ScheduleResult(
            placements=tuple(batch.placements),
            unplaced=batch.unplaced(merged),
            contention=contention(hosts, merged),
        )


class CacheAwarePlacer:
    """QUART §6.2: cached hosts first; key stages sparse (most free GPUs, or KL dispersion under
    contention), other stages packed densely; zygotes of key stages kept where they are."""

    name = "cache-aware"

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()

    # -- scoring of one replica on one host (lower is better) ---------------------------------------

    def _risk(self, host: HostState, req: ReplicaRequest, keys: set[str]) -> tuple[int, int, int]:
        """(needs eviction, key-stage zygotes it could evict, bytes over the limit)."""
        if not host.needs_eviction(req, self.config.memory_fill, self.config.cold_copies):
            return (0, 0, 0)
        over = host.memory_used + int(self.config.cold_copies * req.param_bytes) - host.memory_limit
        return (1, len((host.cached & keys) - {req.function}), over)

    def _key_score(self, host: HostState, req: ReplicaRequest, keys: set[str]) -> tuple:
        return (req.function not in host.cached, *self._risk(host, req, keys), -host.gpu_free, host.name)

    def _dense_score(self, host: HostState, req: ReplicaRequest, keys: set[str]) -> tuple:
        return (req.function not in host.cached, *self._risk(host, req, keys), host.gpu_free, host.name)

    def _greedy(self, states: list[HostState], req: ReplicaRequest, keys: set[str], batch: Batch) -> None:
        is_key = req.function in keys
        score = self._key_score if is_key else self._dense_score
        for _ in range(req.count):
            candidates = [h for h in states if h.fits(req)]
            if not candidates:
                batch.missing[req.function] = batch.missing.get(req.function, 0) + 1
                continue
            best = min(candidates, key=lambda h: score(h, req, keys))
            batch.placements.append(best.take(req, is_key, self.config.cold_copies))

    # -- high contention: KL dispersion of the key stages ---------------------------------------------

    def _problem(self, states: list[HostState], key_reqs: list[ReplicaRequest], keys: set[str]) -> DispersionProblem:
        S, M = len(key_reqs), len(states)
        existing = np.array([[h.running.get(r.function, 0) for h in states] for r in key_reqs], dtype=float)
        feasible = np.array([[h.fits(r) for h in states] for r in key_reqs], dtype=bool)
        cold_cost = np.array(
            [[0.0 if r.function in h.cached else SOURCE_COST[h.source_for(r.function)] + self._risk(h, r, keys)[0]
              for h in states] for r in key_reqs]
        )
        # The greedy (low-contention) plan on a scratch copy is the starting point of the descent.
        scratch = [HostState.of_copy(h) for h in states]
        initial = np.zeros((S, M))
        index = {h.name: j for j, h in enumerate(scratch)}
        probe = Batch()
        for s, r in enumerate(key_reqs):
            start = len(probe.placements)
            self._greedy(scratch, r, keys, probe)
            for p in probe.placements[start:]:
                initial[s, index[p.host]] += 1
        return DispersionProblem(
            requested=np.array([r.count for r in key_reqs], dtype=float),
            existing=existing,
            feasible=feasible,
            capacity=np.array([h.gpu_free for h in states], dtype=float),
            cold_cost=cold_cost,
            initial=initial,
        )

    def _disperse(
        self, states: list[HostState], key_reqs: list[ReplicaRequest], keys: set[str], batch: Batch
    ) -> tuple[float, ...]:
        problem = self._problem(states, key_reqs, keys)
        result = disperse(problem, self.config)
        counts = round_expected(
            result.expected, problem.requested, problem.capacity, problem.feasible, problem.cold_cost
        )
        for s, req in enumerate(key_reqs):
            for j, host in enumerate(states):
                for _ in range(int(counts[s, j])):
                    batch.placements.append(host.take(req, True, self.config.cold_copies))
            missing = req.count - int(counts[s].sum())
            if missing:
                batch.missing[req.function] = batch.missing.get(req.function, 0) + missing
        return result.kl_history

    # -- the Placer protocol -------------------------------------------------------------------------------

    def place(
        self,
        hosts: list[HostView],
        requests: list[ReplicaRequest],
        key_history: dict[str, int] | None = None,
    ) -> ScheduleResult:
        history: Mapping[str, int] = key_history or {}
        states = sorted(_states(hosts), key=lambda h: h.name)  # input order must not matter
        merged = merge_requests(requests)
        keys = {r.function for r in merged if r.key} | {f for f, n in history.items() if n > 0}
        level = contention(hosts, merged)
        # More asked than there are free slots: every function its max-min fair share first, not whoever is placed
        # first; what is cut goes to slots no share could use (a stage that fits nowhere else), else stays unplaced.
        asks, cut = fair_trim(merged, sum(h.gpu_free for h in states))
        # Key stages first (most scaled-up first), so they get the emptiest hosts; then the rest, densely.
        key_reqs = sorted((r for r in asks if r.function in keys), key=lambda r: (-history.get(r.function, 0), r.function))
        other_reqs = [r for r in asks if r.function not in keys]
        batch = Batch()
        kl_history: tuple[float, ...] = ()
        dispersed = bool(key_reqs) and level >= self.config.contention_threshold and len(states) > 1
        if dispersed:
            kl_history = self._disperse(states, key_reqs, keys, batch)
        else:
            for req in key_reqs:
                self._greedy(states, req, keys, batch)
        for req in other_reqs:
            self._greedy(states, req, keys, batch)
        for req in merged:
            if cut.get(req.function):
                self._greedy(states, ReplicaRequest(req.function, cut[req.function], req.param_bytes, req.key), keys,
                             batch)
        keep = sorted({(f, h.name) for h in states for f in h.cached & keys})
        return ScheduleResult(
            placements=tuple(batch.placements),
            unplaced=batch.unplaced(merged),
            keep_cached=tuple(keep),
            contention=level,
            dispersed=dispersed,
            kl_history=kl_history,
        )
