"""ParaServe starts in the gateway (issue 17): which cold stages start in parts, how many, which layers where,
and which replicas the surplus rule must leave alone until their group has consolidated. The rules are the
kernel's, shared with the simulator (P: `quart_kernel.scheduling.paraserve.choose_parts`; parts, groups and
consolidation: `quart_kernel.scheduling.paraserve_groups`); this module reads the stages' layouts from the
registry and keeps the groups in flight.

With ``GatewayConfig.paraserve`` on, a stage that no host holds and that has no replica is *cold*: its P
(``paraserve_parts``, or the smallest P whose predicted first response meets ``paraserve_slo_ms``,
`choose_parts`, from the stage's bytes, each host's NIC
``nic_gbps`` and the registry's ``registry_gbps``) goes to `plan_starts`, which groups the placements into
sub-pipelines (borrowing helpers on spare hosts). The stage's layers are split into P contiguous parts
balanced by bytes (`split_parts`); part i starts on the group's i-th host as a KeysManager part start
(``layers``, ``keysmanager.parts``): it serves its part at once, fetches the rest, and becomes whole. Until
every member of a group is whole (or gone) the group is *protected*: the surplus rule (`choose_surplus`)
sees none of its members, so helpers leave only after consolidation, by draining (no request lost). When a
group is whole, the function's desired count becomes at least the workers the sliding-window rule keeps
(`paraserve_gen.desired_after_consolidation`, from the session engine's demand, ``paraserve_window_s``): the
group scales down to one worker, or up to several, through the registry and the one convergence.

The stage's layout (layer range, per-layer bytes) comes from its manifest in the registry (one GET, cached
per function generation); a stage whose layout cannot be read starts the ordinary way.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence

from quart_kernel.scheduling.paraserve import ParaServeCosts, choose_parts, hosts_from_rates, parts_limit
from quart_kernel.scheduling.paraserve_gen import (
    GenerationCosts,
    GroupDemand,
    desired_after_consolidation,
    plan_generation,
)
from quart_kernel.scheduling.paraserve_groups import (
    Group,
    StageLayout,
    consolidating,
    group_plans,
    layout_of_manifest,
)
from quart_kernel.scheduling.starts import StartPlan
from quart_kernel.scheduling.types import HostView
from quart_provider.config import GatewayConfig
from quart_provider.types import Endpoint, FunctionState

log = logging.getLogger("quart.gateway")


class ParaServeStarts:
    """The gateway's ParaServe state: stage layouts, groups in flight, P per cold function."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.layouts: dict[str, tuple[int, StageLayout | None]] = {}  # function → (generation, layout)
        self.groups: dict[str, list[Group]] = {}  # function → groups not yet consolidated
        self.chosen: list[tuple[str, int]] = []  # (function, P) of every ParaServe start, in order
        self.history: list[Group] = []  # every group started (benchmarks and tests read it)
        self.whole: dict[str, list[Group]] = {}  # function → groups that became whole since `desired_after` looked
        self.kept: list[tuple[str, int]] = []  # (function, desired count) set after each group became whole

    async def layout(self, fn: FunctionState, env: Mapping[str, str]) -> StageLayout | None:
        known = self.layouts.get(fn.name)
        if known is not None and known[0] == fn.generation:
            return known[1]
        layout = None
        url = env.get("QUART_MODEL_URL")
        if url and not env.get("QUART_MODEL_DIR"):
            from keysmanager.registry import ModelRegistry

            try:
                manifest = await asyncio.to_thread(ModelRegistry(url).manifest)
                layout = layout_of_manifest(manifest, int(env.get("QUART_STAGE_INDEX", "0")))
            except Exception as exc:  # any registry trouble: start the ordinary way
                log.warning("%s: no ParaServe layout (%s); cold starts load whole", fn.name, exc)
        self.layouts[fn.name] = (fn.generation, layout)
        return layout

    async def cold_layouts(self, functions: Sequence[str], views: Sequence[HostView],
                           states: Mapping[str, FunctionState], spec_of) -> dict[str, StageLayout]:
        """The layouts of ``functions`` that no host holds and that have no replica (cold)."""
        held = {f for v in views for f in v.cached}
        out = {}
        for function in dict.fromkeys(functions):
            fn = states.get(function)
            if fn is not None and function not in held and not fn.replicas:
                layout = await self.layout(fn, spec_of(fn).env)
                if layout is not None and len(layout.layer_bytes) > 1:
                    out[function] = layout
        return out

    def parts_for(self, views: Sequence[HostView], cold: Mapping[str, StageLayout]) -> dict[str, int]:
        """P per cold function (``cold``: function → layout of stages nobody holds): the gateway's cost model,
        what `quart_kernel.convergence.converge` splits a registry load by."""
        nic = (self.config.paraserve_fetch_gbps or self.config.nic_gbps) * 1e9 / 8
        costs = ParaServeCosts(registry_bytes_s=self.config.registry_gbps * 1e9 / 8 or math.inf,
                               fixed_s=self.config.paraserve_fixed_s, overlap=True,
                               tail_s=self.config.paraserve_tail_s)
        usable = hosts_from_rates({v.name: nic for v in views if v.gpu_free > 0})
        slo = self.config.paraserve_slo_ms / 1000 if self.config.paraserve_slo_ms > 0 else 0.0
        out: dict[str, int] = {}
        for function, layout in cold.items():
            if self.config.paraserve_tpot_slo_ms > 0 and not self.config.paraserve_parts and usable:
                plan = plan_generation(layout.stage_bytes, slo or math.inf, self.config.paraserve_tpot_slo_ms / 1000,
                                       usable, costs, self.generation_costs(), 1,
                                       parts_limit(self.config.paraserve_max_parts, layout.layer_bytes, usable),
                                       layout.layer_bytes)
            else:
                plan = choose_parts(layout.stage_bytes, slo, usable, costs, self.config.paraserve_max_parts,
                                    layout.layer_bytes, self.config.paraserve_parts)
            out[function] = plan.parts
            log.info("%s: cold; ParaServe P = %d (stage %d bytes)", function, plan.parts, layout.stage_bytes)
        return out

    def generation_costs(self) -> GenerationCosts:
        """The whole stage's step costs the generation planner is told (GatewayConfig.paraserve_*_ms)."""
        c = self.config
        return GenerationCosts(0.0, c.paraserve_decode_ms / 1000, c.paraserve_hop_ms / 1000,
                               prefill_min_s=c.paraserve_prefill_ms / 1000)

    def plan_groups(self, plans: Sequence[StartPlan], layouts: Mapping[str, StageLayout]) -> dict[int, Group]:
        """The group of each ``paraserve`` plan (by index), one `Group` per sub-pipeline (`group_plans`)."""
        by_plan, new = group_plans(plans, layouts)
        for group in new:
            self.groups.setdefault(group.function, []).append(group)
            self.chosen.append((group.function, len(group.hosts)))
            self.history.append(group)
        return by_plan

    def protected(self, fn: FunctionState) -> set[str]:
        """Replica ids of ``fn`` the surplus rule must not take: members of groups still `consolidating`. A group
        whose members are all whole (or gone) is done and forgotten."""
        keep: set[str] = set()
        groups = self.groups.get(fn.name, [])
        for group in list(groups):
            alive = [fn.replicas[r] for r in group.members if r in fn.replicas]
            if not consolidating(group.pending, (_whole(e) for e in alive)):
                groups.remove(group)
                self.whole.setdefault(fn.name, []).append(group)
                continue
            keep.update(e.id for e in alive)
        return keep


    def desired_after(self, fn: FunctionState, demand: GroupDemand, now: float) -> int | None:
        """The desired count of ``fn`` once its groups that became whole since the last call are whole
        (`desired_after_consolidation`); None when none did."""
        done = self.whole.pop(fn.name, [])
        if not done:
            return None
        size = max(len(g.hosts) for g in done)
        desired = desired_after_consolidation(fn.desired, demand, now, self.config.paraserve_window_s, size)
        self.kept.append((fn.name, desired))
        log.info("%s: ParaServe group of %d whole; desired %d -> %d (%d sessions in the last %.0f s, %d waiting, "
                 "%d per worker)", fn.name, size, fn.desired, desired,
                 sum(1 for t in demand.arrivals if now - self.config.paraserve_window_s < t <= now), demand.waiting,
                 demand.per_worker)
        return desired


def _whole(endpoint: Endpoint) -> bool:
    return endpoint.state == "ready" and endpoint.whole

