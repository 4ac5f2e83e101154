"""Scale-up sources of the simulator (issues 16, 17): peer fetch, chain multicast, live (BlitzScale) and
ParaServe starts, beside the KeysManager fork and the cold start. A mixin of `quart_tools.sim.engine.Simulation`.

Which mechanism a new replica uses is decided by the one convergence (`quart_kernel.convergence`, the live
rule `plan_starts` over the placer's placements); P of a ParaServe start is the live planner's
(`quart_kernel.scheduling.paraserve.plan_parallelism`) over this cluster's costs. This module is the data
plane of a start: its timing comes from `Calibration`:

- peer / multicast: ready after the transfer (the source's NIC shared by the receivers of a star; one chain
  hop per place in a chain), then a fork and the host → GPU copy (`Calibration.peer_s`);
- live: layers stream on to the GPU (`Calibration.live_schedule`); from the first layer on, the new replica
  takes requests from the stage's queue, runs the prefix of layers it holds (the fraction of layers arrived
  when it starts the request) and hands the rest of the request's compute (plus one hop) to a full replica of
  the stage, which takes these remainders before new requests; when the last layer is in it is a full replica;
- paraserve: P replicas on P hosts serve as one sub-pipeline once every part is in (each with the service
  time plus (P − 1) hops, so P of them give the sub-pipeline's throughput), and serve alone at the stage's
  service time once each has fetched the rest in the background (`Calibration.paraserve_s`).
"""

from __future__ import annotations

import heapq
import math

from quart_kernel.scheduling import ParaServeCosts, plan_parallelism
from quart_kernel.scheduling.paraserve import FetchHost
from quart_tools.sim.calibration import GB

_COMPLETE, _READY = 0, 1  # the engine's events
LIVE_FIRST, PARTIAL_DONE, CONSOLIDATED = 4, 5, 6  # this module's


class StartsMixin:
    """Start a placed replica by its mechanism; run live replicas' partial requests and their remainders."""

    # ---------------------------------------------------------------------------- scale-up
    def _paraserve_parts(self, function: str, hosts) -> int:
        """P of a ParaServe start of ``function`` over ``hosts`` (those with a free slot fetch a part each): the
        convergence's ``parallelism``, from this cluster's calibrated costs."""
        stage = self.stage_by_fn[function]
        cal, cfg = self.cal, self.cfg
        costs = ParaServeCosts(registry_bytes_s=cal.registry_gbytes_s * GB, h2d_bytes_s=cal.h2d_gbps * GB,
                               fixed_s=cal.cold_fixed_s, hop_s=self._part_hop_s(stage),
                               service_s=stage.spec.service_s, overlap=cal.paraserve_overlap)
        slo = cfg.paraserve_slo_s or cfg.slo_s or cfg.slo_factor * sum(s.spec.service_s for s in self.stages)
        fetch = [FetchHost(h.name, cal.disk_gbps * GB) for h in hosts if h.gpu_free > 0]
        plan = plan_parallelism(stage.spec.param_bytes, slo, fetch, costs, max_parts=cfg.paraserve_max_parts)
        self.paraserve_plans.append((plan.parts, plan.first_response_s, plan.meets_slo))
        return plan.parts

    def _part_hop_s(self, stage) -> float:
        """One hop between two parts of a sub-pipeline: the router hop plus the activations over the NIC."""
        return self.cfg.hop_s + stage.spec.activation_bytes / (self.cal.nic_gbytes_s * GB)

    def _launch(self, stage, host, mode: str, now: float, plan=None) -> None:
        """Start one replica of ``stage`` on ``host`` by ``mode`` (its `StartPlan`'s); ready after its delay.
        The host decides what it can do, as a live host reports its start's source: without a KeysManager there
        is no zygote to fork (the placer counts on one for a second replica in a batch), so that start is cold."""
        if mode == "fork" and not host.keysmanager:
            mode = "cold"
        rep = self._new_replica(stage, host, mode, now)
        mode = rep.source  # "gpu" when the parameters were still resident
        size = stage.spec.param_bytes
        cal = self.cal
        if mode in ("fork", "gpu"):
            host.touch(stage.function, now)
        elif not self.cfg.cache_on_ready:
            host.cache_stage(stage.function, size, now)
        if mode in ("gpu", "fork", "cold"):
            delay = cal.ready_s(mode, size)
        elif mode in ("peer", "multicast"):
            delay = cal.peer_s(size, plan.sharers, plan.position)
        elif mode == "live":
            first, step, layers = cal.live_schedule(size, plan.sharers, plan.position)
            rep.layer0, rep.layer_dt, rep.layers = now + first, step, layers
            delay = first + (layers - 1) * step
            self._push(now + first, LIVE_FIRST, rep)
        elif mode == "paraserve":
            parts = len(plan.group)
            delay, consolidated = cal.paraserve_s(size, parts)
            slower = 1.0 + (parts - 1) * self._part_hop_s(stage) / max(stage.spec.service_s, 1e-9)
            rep.factor *= slower
            rep.group = self._groups.setdefault((stage.index, plan.group, now), [])
            rep.group.append(rep)
            self._push(now + consolidated, CONSOLIDATED, rep)
            for name in plan.helpers:  # borrowed workers: serve their part until the group has consolidated
                helper = self._new_replica(stage, self.host_by_name[name], "paraserve", now)
                helper.helper = True
                helper.factor *= slower
                helper.group = rep.group
                rep.group.append(helper)
                self.launched.append(helper)
                self._push(now + delay, _READY, helper)
                self._push(now + consolidated, CONSOLIDATED, helper)
        else:
            raise ValueError(f"unknown start mode {mode!r}")
        self.starts_by_source[mode] = self.starts_by_source.get(mode, 0) + 1
        self.launched.append(rep)
        stage.starting.append(rep)
        self._push(now + delay, _READY, rep)

    def _start_event(self, kind: int, payload, now: float) -> None:
        if kind == LIVE_FIRST:
            self._live_first(payload, now)
        elif kind == PARTIAL_DONE:
            self._partial_done(*payload, now)
        elif kind == CONSOLIDATED:
            self._consolidated(payload, now)

    def _consolidated(self, rep, now: float) -> None:
        """A ParaServe group holds the whole stage on each kept worker: they serve alone, helpers leave."""
        rep.consolidated_at = now
        rep.factor = self.cal.cpu_factor(rep.cpus)
        stage = self.stages[rep.stage]
        if rep.helper:
            if rep.state == "ready" and rep.in_flight:
                rep.state = "draining"
            elif rep.state == "ready":
                stage.free.remove(rep)
                self._release(rep, now)
        elif self.cfg.cache_on_ready and rep.state in ("ready", "starting"):
            rep.host.cache_stage(stage.function, stage.spec.param_bytes, now)

    def _group_stopped(self, stage, rep, now: float) -> None:
        """A ParaServe replica was stopped: once no replica of its group is left, its helpers leave too (the
        sub-pipeline's other parts; the simulator lets the remaining replicas cover a stopped one's part)."""
        if any(r.state in ("starting", "ready") for r in rep.group if not r.helper):
            return
        for helper in rep.group:
            if not helper.helper or helper.state in ("gone", "draining"):
                continue
            if helper.in_flight:
                helper.state = "draining"
                continue
            if helper in stage.free:
                stage.free.remove(helper)
            self._release(helper, now)

    def _helper_ready(self, stage, rep, now: float) -> None:
        rep.state = "ready"
        rep.ready_at = now
        self._serve_next(stage, rep, now)

    # --------------------------------------------------------------------------------- live
    def _live_first(self, rep, now: float) -> None:
        if rep.state != "starting":
            return
        rep.live = True
        self._live_next(self.stages[rep.stage], rep, now)

    def _live_next(self, stage, rep, now: float) -> None:
        """A live (partly loaded) replica is free: it takes the oldest waiting request, or waits."""
        if stage.queue:
            req, enq = stage.queue.popleft()
            self._partial(req, stage, rep, now, enq)
        else:
            stage.live_free.append(rep)

    def _partial(self, req: int, stage, rep, now: float, enqueued: float) -> None:
        stage.metrics.on_dispatch(now, now - enqueued)
        stage.busy += 1
        rep.in_flight += 1
        held = min(rep.layers, max(1, math.floor((now - rep.layer0) / rep.layer_dt) + 1))
        fraction = held / rep.layers
        full = stage.spec.service_s * rep.factor * stage.draws[req]
        part = fraction * full + self.hop_in_service
        self.seq += 1
        heapq.heappush(self.heap, (now + part, self.seq, PARTIAL_DONE, (req, rep, full - fraction * full, part)))

    def _partial_done(self, req: int, rep, remainder: float, part: float, now: float) -> None:
        stage = self.stages[rep.stage]
        stage.busy -= 1
        rep.in_flight -= 1
        if rep.first_done < 0:
            rep.first_done = now
        if remainder <= 0:
            stage.metrics.on_complete(now, part)
            self._advance(req, rep.stage, now)
        else:
            stage.remainders.append((req, remainder + self.hop_in_service, part))
            if stage.free:
                self._serve_next(stage, stage.free.pop(), now)
        if rep.state == "draining":
            self._release(rep, now)
        elif rep.state == "ready":
            self._serve_next(stage, rep, now)
        elif rep.live:
            self._live_next(stage, rep, now)

    def _start_remainder(self, stage, rep, now: float) -> None:
        """A full replica runs the layers a live replica did not hold, for the oldest such request."""
        req, remainder, part = stage.remainders.popleft()
        stage.busy += 1
        rep.in_flight += 1
        self.seq += 1
        heapq.heappush(self.heap, (now + remainder, self.seq, _COMPLETE, (req, rep, remainder + part)))

    def _live_ready(self, stage, rep) -> None:
        """A live replica holds every layer now: it leaves the live pool (the engine makes it a full one)."""
        rep.live = False
        if rep in stage.live_free:
            stage.live_free.remove(rep)
