"""ParaServe groups (ParaServe §4.1, issue 17): which layers each part of a cold stage holds, which start plans
form one sub-pipeline, and when a group is still protected from the surplus rule. Pure; the gateway
(`quart_provider.paraserve_start`) and the simulator (`quart_tools.sim`) both use it.

A stage's layers are split into P contiguous parts balanced by bytes (`split_parts`); part i starts on the
group's i-th host. Until every member of a group is whole (or gone) and no start of it is unanswered, the group
is *consolidating*: none of its members is surplus, so helpers leave only after consolidation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from quart_kernel.scheduling.paraserve import split_parts
from quart_kernel.scheduling.starts import StartPlan


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


def layout_of_manifest(manifest: dict, stage_index: int) -> StageLayout | None:
    """The layout of stage ``stage_index`` of a model manifest (None without per-layer byte ranges: it cannot
    start in parts)."""
    stages = manifest.get("stages") or []
    if not 0 <= stage_index < len(stages):
        return None
    entry = stages[stage_index]
    spans = entry.get("layer_bytes")
    if not spans or not entry.get("layer_sha256") or entry.get("end", 0) - entry.get("start", 0) != len(spans):
        return None
    return StageLayout(int(entry["start"]), int(entry["end"]), tuple(int(b) - int(a) for a, b in spans))


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


def group_plans(plans: Sequence[StartPlan], layouts: Mapping[str, StageLayout]) -> tuple[dict[int, Group], list[Group]]:
    """The group of each ``paraserve`` plan (by index; a group's first plan carries its helpers), and the new
    groups in order. A plan whose function has no layout is not grouped (it starts the ordinary way)."""
    out: dict[int, Group] = {}
    new: list[Group] = []
    current: dict[tuple[str, tuple[str, ...]], Group] = {}
    for i, plan in enumerate(plans):
        if plan.mode != "paraserve" or plan.function not in layouts:
            continue
        key = (plan.function, plan.group)
        if plan.helpers or key not in current:
            current[key] = Group(plan.function, plan.group, layouts[plan.function].parts(len(plan.group)))
            new.append(current[key])
        out[i] = current[key]
    return out, new


def consolidating(pending: int, alive_whole: Iterable[bool]) -> bool:
    """A group is still consolidating (its members are protected from the surplus rule) while a start of it is
    unanswered or one of its live members (``alive_whole``: each one's wholeness) does not hold the whole
    stage yet."""
    return pending > 0 or not all(alive_whole)
