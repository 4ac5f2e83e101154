"""ParaServe starts in the gateway (issue 17): which cold stages start in parts, how many, which layers where,
and which replicas the surplus rule must leave alone until their group has consolidated.

With ``GatewayConfig.paraserve`` on, a stage that no host holds and that has no replica is *cold*: its P
(``paraserve_parts``, or the smallest P whose predicted first response meets ``paraserve_slo_ms``,
`quart_kernel.scheduling.paraserve.plan_parallelism`, from the stage's bytes, each host's NIC
``nic_gbps`` and the registry's ``registry_gbps``) goes to `plan_starts`, which groups the placements into
sub-pipelines (borrowing helpers on spare hosts). The stage's layers are split into P contiguous parts
balanced by bytes (`split_parts`); part i starts on the group's i-th host as a KeysManager part start
(``layers``, ``keysmanager.parts``): it serves its part at once, fetches the rest, and becomes whole. Until
every member of a group is whole (or gone) the group is *protected*: the surplus rule (`choose_surplus`)
sees none of its members, so helpers leave only after consolidation, by draining (no request lost).

The stage's layout (layer range, per-layer bytes) comes from its manifest in the registry (one GET, cached
per function generation); a stage whose layout cannot be read starts the ordinary way.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from quart_kernel.scheduling.paraserve import (
    ParaServeCosts,
    hosts_from_rates,
    plan_parallelism,
    split_parts,
)
from quart_kernel.scheduling.starts import StartPlan
from quart_kernel.scheduling.types import HostView
from quart_provider.config import GatewayConfig
from quart_provider.types import Endpoint, FunctionState

log = logging.getLogger("quart.gateway")


@dataclass(frozen=True, slots=True)
class StageLayout:
    """A stage's layers ``[start, end)`` and each one's bytes in its file."""

    start: int
    end: int
    layer_bytes: tuple[int, ...]

    @property
    def stage_bytes(self) -> int:
        return sum(self.layer_bytes)

    def parts(self, count: int) -> list[tuple[int, int]]:
        """``count`` absolute layer ranges balanced by bytes."""
        return [(self.start + a, self.start + b) for a, b in split_parts(self.layer_bytes, count)]


@dataclass
class Group:
    """One sub-pipeline: its hosts in part order, the parts, and the replica ids started for it."""

    function: str
    hosts: tuple[str, ...]
    parts: list[tuple[int, int]]
    members: set[str] = field(default_factory=set)
    pending: int = 0  # starts not answered yet (set to the group's size)

    def __post_init__(self) -> None:
        self.pending = len(self.hosts)

    def started(self, ids: Sequence[str]) -> None:
        """One start answered (``ids``: the replicas it started; none when it failed)."""
        self.members.update(ids)
        self.pending = max(0, self.pending - 1)

    def part_on(self, host: str) -> tuple[int, int]:
        return self.parts[self.hosts.index(host)]


def layout_of_manifest(manifest: dict, stage_index: int) -> StageLayout | None:
    """The layout of stage ``stage_index`` (None without per-layer byte ranges: it cannot start in parts)."""
    stages = manifest.get("stages") or []
    if not 0 <= stage_index < len(stages):
        return None
    entry = stages[stage_index]
    spans = entry.get("layer_bytes")
    if not spans or not entry.get("layer_sha256") or entry.get("end", 0) - entry.get("start", 0) != len(spans):
        return None
    return StageLayout(int(entry["start"]), int(entry["end"]), tuple(int(b) - int(a) for a, b in spans))


class ParaServeStarts:
    """The gateway's ParaServe state: stage layouts, groups in flight, P per cold function."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.layouts: dict[str, tuple[int, StageLayout | None]] = {}  # function → (generation, layout)
        self.groups: dict[str, list[Group]] = {}  # function → groups not yet consolidated
        self.chosen: list[tuple[str, int]] = []  # (function, P) of every ParaServe start, in order
        self.history: list[Group] = []  # every group started (benchmarks and tests read it)

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
        usable = [v.name for v in views if v.gpu_free > 0]
        out: dict[str, int] = {}
        for function, layout in cold.items():
            limit = min(self.config.paraserve_max_parts, len(layout.layer_bytes), max(1, len(usable)))
            if self.config.paraserve_parts:
                parts = min(self.config.paraserve_parts, limit)
            else:
                slo = self.config.paraserve_slo_ms / 1000 if self.config.paraserve_slo_ms > 0 else 0.0
                plan = plan_parallelism(layout.stage_bytes, slo, hosts_from_rates(dict.fromkeys(usable, nic)),
                                        costs, max_parts=limit, layer_bytes=layout.layer_bytes)
                parts = plan.parts
            out[function] = parts
            log.info("%s: cold; ParaServe P = %d (stage %d bytes)", function, parts, layout.stage_bytes)
        return out

    def plan_groups(self, plans: Sequence[StartPlan], layouts: Mapping[str, StageLayout]) -> dict[int, Group]:
        """The group of each ``paraserve`` plan (by index), one `Group` per sub-pipeline."""
        out: dict[int, Group] = {}
        current: dict[tuple[str, tuple[str, ...]], Group] = {}
        for i, plan in enumerate(plans):
            if plan.mode != "paraserve" or plan.function not in layouts:
                continue
            key = (plan.function, plan.group)
            if plan.helpers or key not in current:  # a group's first plan carries its helpers
                group = Group(plan.function, plan.group, layouts[plan.function].parts(len(plan.group)))
                current[key] = group
                self.groups.setdefault(plan.function, []).append(group)
                self.chosen.append((plan.function, len(plan.group)))
                self.history.append(group)
            out[i] = current[key]
        return out

    def protected(self, fn: FunctionState) -> set[str]:
        """Replica ids of ``fn`` the surplus rule must not take: members of groups not yet all whole. A group
        whose members are all whole (or gone) is done and forgotten."""
        keep: set[str] = set()
        groups = self.groups.get(fn.name, [])
        for group in list(groups):
            alive = [fn.replicas[r] for r in group.members if r in fn.replicas]
            if not group.pending and all(_whole(e) for e in alive):
                groups.remove(group)
                continue
            keep.update(e.id for e in alive)
        return keep


def _whole(endpoint: Endpoint) -> bool:
    return endpoint.state == "ready" and endpoint.whole
