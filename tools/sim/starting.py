"""Replica starts of the simulator (issues 16, 17): placing, starting, readying, stopping and releasing replicas
by their mechanism — the KeysManager fork, the cold start, peer fetch, chain multicast, live (BlitzScale) and
ParaServe starts.

Which mechanism a new replica uses is decided by the one convergence (`quart_kernel.convergence`, the live
rule `plan_starts` over the placer's placements); P of a ParaServe start is the gateway's rule
(`quart_kernel.scheduling.paraserve.choose_parts`) over this cluster's costs. This module is the timing
of a start, from `Calibration`:

- gpu / fork / cold: ready after the mechanism's delay (`Calibration.ready_s`);
- peer / multicast: ready after the transfer (the source's NIC shared by the receivers of a star; one chain
  hop per place in a chain), then a fork and the host → GPU copy (`Calibration.peer_s`);
- live: layers stream on to the GPU (`Calibration.live_schedule`); from the first layer on the data plane
  (`quart_tools.sim.dataplane`) routes requests to it; when the last layer is in it is a full replica;
- paraserve: P replicas on P hosts serve as one sub-pipeline once every part is in (each with the service
  time plus (P − 1) hops, so P of them give the sub-pipeline's throughput), and serve alone at the stage's
  service time once each has fetched the rest in the background (`Calibration.paraserve_s`).
"""

from __future__ import annotations

from collections.abc import Callable

from quart_kernel.scheduling import FetchHost, ParaServeCosts, ReplicaRequest, StartPlan
from quart_kernel.scheduling.paraserve import choose_parts
from quart_tools.sim.calibration import GB
from quart_tools.sim.cluster import Host
from quart_tools.sim.dataplane import leave_live_pool
from quart_tools.sim.events import CONSOLIDATED, LIVE_FIRST, READY, EventLoop
from quart_tools.sim.state import Replica, SimConfig, Tally, _Stage


class ReplicaStarts:
    """The replicas' lifecycle on the simulated hosts: a start by its mechanism, ready, stop, release.

    ``flow`` (the data plane, whose ``on_ready`` takes a loaded replica) and ``converge`` (the control loop's
    convergence, run when a rolling update may retire the previous generation) are wired by the engine."""

    def __init__(self, cfg: SimConfig, stages: list[_Stage], hosts: list[Host], loop: EventLoop,
                 tally: Tally) -> None:
        self.cfg, self.cal, self.stages, self.hosts, self.loop, self.tally = \
            cfg, cfg.calibration, stages, hosts, loop, tally
        self.host_by_name = {h.name: h for h in hosts}
        self.stage_by_fn = {st.function: st for st in stages}
        self.next_replica = 0
        self.groups: dict = {}  # ParaServe groups of this run: (stage, hosts, start time) → members
        self.flow = None
        self.converge: Callable[[float], object] = lambda now: None

    # ------------------------------------------------------------------------------ slots
    def _new_replica(self, stage: _Stage, host: Host, source: str, now: float) -> Replica:
        slot, resident = host.take_slot(stage.function, now)
        if resident:
            source = "gpu"
        rep = Replica(self.next_replica, stage.index, host, slot, source, now, stage.cpus, stage.generation)
        rep.factor = self.cal.cpu_factor(stage.cpus)
        self.next_replica += 1
        host.occupy(slot, rep, stage.function)
        return rep

    def place_initial(self, placer) -> None:
        """``initial_replicas`` per stage, placed by the placer, ready at t = 0 (as after a deploy)."""
        cfg = self.cfg
        reqs = [ReplicaRequest(s.function, cfg.initial_replicas, s.spec.param_bytes) for s in self.stages]
        result = placer.place([h.view() for h in self.hosts], reqs, {})
        for p in result.placements:
            stage, host = self.stage_by_fn[p.function], self.host_by_name[p.host]
            host.cache_stage(stage.function, stage.spec.param_bytes, 0.0)
            rep = self._new_replica(stage, host, "gpu", 0.0)
            rep.state = "ready"
            stage.ready[rep] = None
            stage.free.append(rep)
        if result.unplaced:
            raise ValueError(f"the cluster cannot hold the initial replicas: {result.unplaced}")
        if cfg.keysmanager:  # deploy-time prefetch: caches as on a cluster that has served the model
            count = len(self.hosts) if cfg.prewarm_hosts < 0 else cfg.prewarm_hosts
            for host in self.hosts[:count]:
                for st in self.stages:
                    host.cache_stage(st.function, st.spec.param_bytes, 0.0)

    def release(self, rep: Replica, now: float) -> None:
        """A replica is gone: its slot's time is counted and the slot freed."""
        rep.state = "gone"
        self.tally.gpu_seconds += now - rep.requested_at
        self.tally.cpu_seconds += (now - rep.requested_at) * rep.cpus + rep.cpu_extra_s
        rep.host.release_slot(rep.slot, self.stages[rep.stage].function, now, self.cfg.gpu_keep_s)

    # ---------------------------------------------------------------------------- scale-up
    def paraserve_parts(self, function: str, hosts) -> int:
        """P of a ParaServe start of ``function`` over ``hosts`` (those with a free slot fetch a part each): the
        convergence's ``parallelism``, from this cluster's calibrated costs."""
        stage = self.stage_by_fn[function]
        cal, cfg = self.cal, self.cfg
        costs = ParaServeCosts(registry_bytes_s=cal.registry_gbytes_s * GB, h2d_bytes_s=cal.h2d_gbps * GB,
                               fixed_s=cal.cold_fixed_s, hop_s=self._part_hop_s(stage),
                               service_s=stage.spec.service_s, overlap=cal.paraserve_overlap)
        slo = cfg.paraserve_slo_s or cfg.slo_s or cfg.slo_factor * sum(s.spec.service_s for s in self.stages)
        fetch = [FetchHost(h.name, cal.disk_gbps * GB) for h in hosts if h.gpu_free > 0]
        plan = choose_parts(stage.spec.param_bytes, slo, fetch, costs, cfg.paraserve_max_parts)
        self.tally.paraserve_plans.append((plan.parts, plan.first_response_s, plan.meets_slo))
        return plan.parts

    def _part_hop_s(self, stage: _Stage) -> float:
        """One hop between two parts of a sub-pipeline: the router hop plus the activations over the NIC."""
        return self.cfg.hop_s + stage.spec.activation_bytes / (self.cal.nic_gbytes_s * GB)

    def launch(self, stage: _Stage, host: Host, mode: str, now: float, plan: StartPlan | None = None) -> None:
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
            self.loop.push(now + first, LIVE_FIRST, rep)
        elif mode == "paraserve":
            delay = self._launch_group(stage, rep, plan, now)
        else:
            raise ValueError(f"unknown start mode {mode!r}")
        tally = self.tally
        tally.starts_by_source[mode] = tally.starts_by_source.get(mode, 0) + 1
        tally.launched.append(rep)
        stage.starting.append(rep)
        self.loop.push(now + delay, READY, rep)

    def _launch_group(self, stage: _Stage, rep: Replica, plan: StartPlan, now: float) -> float:
        """A ParaServe part and the group's borrowed helpers; returns the delay until the sub-pipeline serves."""
        parts = len(plan.group)
        delay, consolidated = self.cal.paraserve_s(stage.spec.param_bytes, parts)
        slower = 1.0 + (parts - 1) * self._part_hop_s(stage) / max(stage.spec.service_s, 1e-9)
        rep.factor *= slower
        rep.group = self.groups.setdefault((stage.index, plan.group, now), [])
        rep.group.append(rep)
        self.loop.push(now + consolidated, CONSOLIDATED, rep)
        for name in plan.helpers:  # borrowed workers: serve their part until the group has consolidated
            helper = self._new_replica(stage, self.host_by_name[name], "paraserve", now)
            helper.helper = True
            helper.factor *= slower
            helper.group = rep.group
            rep.group.append(helper)
            self.tally.launched.append(helper)
            self.loop.push(now + delay, READY, helper)
            self.loop.push(now + consolidated, CONSOLIDATED, helper)
        return delay

    def ready(self, rep: Replica, now: float) -> None:
        """A replica (or a ParaServe helper) is loaded (a `READY` event): it serves from now on."""
        if rep.state != "starting":
            return  # cancelled while starting
        st = self.stages[rep.stage]
        if rep.helper:
            rep.state = "ready"
            rep.ready_at = now
            self.flow.on_ready(st, rep, now)
            return
        st.starting.remove(rep)
        leave_live_pool(st, rep)
        rep.state = "ready"
        rep.ready_at = now
        if self.cfg.cache_on_ready and rep.source in ("cold", "peer", "multicast", "live"):
            rep.host.cache_stage(st.function, st.spec.param_bytes, now)
        took = now - rep.requested_at
        self.tally.ready_s_by_source.setdefault(rep.source, []).append(took)
        st.start_time.note(took)
        st.ready[rep] = None
        self.flow.on_ready(st, rep, now)
        if any(r.generation != st.generation for r in st.ready):
            self.converge(now)  # a rolling update may retire the previous generation now

    def resize(self, rep: Replica, cpus: float, now: float) -> None:
        """An in-place CPU change (a ``resize`` action): from now on the replica serves at ``cpus``' speed (work
        under way keeps its end: the live replica's threads change between requests); CPU-seconds are counted at
        each CPU count for the time it held it."""
        rep.cpu_extra_s += (now - rep.requested_at) * (rep.cpus - cpus)  # so (end − start) × cpus adds up
        rep.factor *= self.cal.cpu_factor(cpus) / self.cal.cpu_factor(rep.cpus)  # a ParaServe part keeps its share
        rep.cpus = cpus

    # ---------------------------------------------------------------------------- scale-down
    def stop(self, st: _Stage, rep: Replica, now: float) -> None:
        """Drain and stop one replica: at once if it serves nothing, after its request otherwise."""
        if rep.state == "starting":
            st.starting.remove(rep)
            leave_live_pool(st, rep)  # a live replica may be running its part of a request
        else:
            st.ready.pop(rep, None)
            if not rep.in_flight:
                st.free.remove(rep)
        if rep.in_flight:
            rep.state = "draining"
        else:
            self.release(rep, now)
        if rep.group is not None:
            self._group_stopped(st, rep, now)

    def consolidated(self, rep: Replica, now: float) -> None:
        """A ParaServe group holds the whole stage on each kept worker (a `CONSOLIDATED` event): they serve alone,
        helpers leave (the data plane first moves what it must, a generation session's KV)."""
        self.flow.before_consolidated(rep, now)
        rep.consolidated_at = now
        rep.factor = self.cal.cpu_factor(rep.cpus)
        stage = self.stages[rep.stage]
        if rep.helper:
            if rep.state == "ready" and rep.in_flight:
                rep.state = "draining"
            elif rep.state == "ready":
                stage.free.remove(rep)
                self.release(rep, now)
        elif self.cfg.cache_on_ready and rep.state in ("ready", "starting"):
            rep.host.cache_stage(stage.function, stage.spec.param_bytes, now)

    def _group_stopped(self, stage: _Stage, rep: Replica, now: float) -> None:
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
            self.release(helper, now)
