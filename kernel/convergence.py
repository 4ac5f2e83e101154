"""One convergence: the platform's view in, the actions that make it match the desired state out. Pure.

The live reconciler (:mod:`quart_provider.reconciler`) and the simulator (``quart_tools.sim.engine``) each
build a :class:`PlatformView` of what they run — functions with their desired count and generation, their
replicas, starts asked for and not answered yet, the retry back-off after a failed start, the ParaServe
groups not consolidated yet, and the hosts as the placer sees them — call :func:`converge`, and carry out
the :class:`Action` s it returns: the live gateway by asking hosts, the simulator by scheduling events.

The rules (:mod:`.replicaset`, :mod:`.scheduling`):

- a function short of its desired count asks the placer for the shortfall (desired − current − pending),
  unless its back-off after a failed start has not run out; each placement becomes a ``start`` with the
  mechanism that moves its parameters (`plan_starts`: fork, peer, chain multicast, live, ParaServe part,
  cold) — ParaServe's P comes from the caller's cost model (``parallelism``);
- a function with too many replicas stops the surplus (`choose_surplus`); members of a ParaServe group not
  consolidated yet are never surplus (the group leaves only whole); a replica holding generation sessions
  (``kv_tokens``) leaves after every one without, the fewest positions first: ``stop`` for a replica that
  serves nothing, ``drain`` for one with requests in flight or sessions;
- a rolling update ``retire`` s the previous generation once the new one has its desired ready replicas;
- a ready replica whose CPUs differ from its function's is ``resize`` d in place (:mod:`.resize`: a CPU-only
  change is no rolling update).

``stop``, ``drain`` and ``retire`` are all carried out as drain-then-stop (nothing is cut off); the kind
says why the replica leaves; ``resize`` leaves it serving.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from quart_kernel.replicaset import choose_surplus, rollover_done, shortfall
from quart_kernel.resize import resizes
from quart_kernel.scheduling.starts import StartPlan, plan_starts
from quart_kernel.scheduling.types import HostView, Placer, ReplicaRequest, ScheduleResult

ActionKind = Literal["start", "stop", "drain", "retire", "resize"]
Parallelism = Callable[[str, Sequence[HostView]], int]  # (function, hosts) → P of a ParaServe cold start


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as convergence reads it (``state``: starting | ready | draining)."""

    id: str
    state: str
    generation: int
    in_flight: int = 0
    started_at: float = 0.0
    kv_tokens: int = 0  # KV-cache positions its generation sessions hold (the gateway's book; 0 without)
    cpus: float = 0.0  # CPUs it runs with (0: not reported)


@dataclass(frozen=True, slots=True)
class FunctionView:
    """One function: what it should run and what it runs."""

    name: str
    desired: int
    generation: int
    replicas: tuple[ReplicaView, ...] = ()
    pending_starts: int = 0  # starts asked of a host and not answered yet (counted as current)
    retry_at: float = 0.0  # back-off: no new start before this time (after a failed start)
    protected: frozenset[str] = frozenset()  # ParaServe group members not consolidated yet
    param_bytes: int = 0  # what a host caches of it (placement)
    key: bool = False  # a key stage scaled up before (the placer's key-stage history)
    serving: int = 0  # replicas serving their whole stage now (a live start needs one)
    cpus: float = 0.0  # CPUs per replica it should run with (0: not managed; a change resizes in place)


@dataclass(frozen=True, slots=True)
class PlatformView:
    """The platform at one instant."""

    now: float
    functions: tuple[FunctionView, ...]
    hosts: tuple[HostView, ...] = ()  # as the placer sees them (slots taken by pending starts included)
    key_history: Mapping[str, int] = field(default_factory=dict)
    mechanisms: frozenset[str] = frozenset()  # start mechanisms switched on (`scheduling.starts.MECHANISMS`)


@dataclass(frozen=True, slots=True)
class Action:
    """One thing to do: ``start`` a replica (``plan`` says where and how), let ``replica`` go, or ``resize`` it
    to ``cpus``."""

    kind: ActionKind
    function: str
    replica: str = ""  # stop / drain / retire
    plan: StartPlan | None = None  # start
    key: bool = False  # start: placed as a key stage
    placed: str = ""  # start: where the placer found the parameters (gpu / fork / peer / cold)
    cpus: float = 0.0  # resize: the CPUs it gets

    def shape(self) -> tuple:
        """What the action does, without the replica id (ids differ between the platform and the simulator)."""
        plan = self.plan
        if plan is None:
            return (self.kind, self.function, self.cpus) if self.kind == "resize" else (self.kind, self.function)
        return (self.kind, self.function, plan.host, plan.mode, plan.source, plan.position, plan.sharers,
                plan.group, plan.helpers)


@dataclass(frozen=True, slots=True)
class Convergence:
    """What :func:`converge` decided: the actions in order (stops first, then resizes, then starts), and the
    placer's answer."""

    actions: tuple[Action, ...]
    schedule: ScheduleResult | None = None  # None when nothing was missing

    @property
    def starts(self) -> list[Action]:
        return [a for a in self.actions if a.kind == "start"]


def requests(view: PlatformView) -> list[ReplicaRequest]:
    """The placer's requests: each function's shortfall, unless it is backing off after a failed start."""
    out = []
    for fn in view.functions:
        missing = shortfall(fn.desired, len(_current(fn)), fn.pending_starts)
        if missing and view.now >= fn.retry_at:
            out.append(ReplicaRequest(fn.name, missing, param_bytes=fn.param_bytes, key=fn.key))
    return out


def leaving(view: PlatformView) -> list[Action]:
    """The replicas to let go: each function's surplus (ParaServe groups kept whole), then the previous
    generation of a rolling update that is done."""
    actions = []
    for fn in view.functions:
        current = _current(fn)
        kept = [r for r in current if r.id in fn.protected]
        for rep in choose_surplus([r for r in current if r.id not in fn.protected], fn.desired - len(kept)):
            actions.append(Action("drain" if rep.in_flight or rep.kv_tokens else "stop", fn.name, rep.id))
        ready = sum(1 for r in current if r.state == "ready")
        old = [r for r in fn.replicas if r.generation != fn.generation and r.state != "draining"]
        if old and rollover_done(ready, fn.desired):
            actions.extend(Action("retire", fn.name, r.id) for r in old)
    return actions


def resizing(view: PlatformView, leave: Sequence[Action] = ()) -> list[Action]:
    """The replicas to resize in place (:func:`quart_kernel.resize.resizes`), none of those in ``leave``."""
    gone = {a.replica for a in leave}
    return [Action("resize", fn, rep, cpus=cpus) for fn, rep, cpus in resizes(view.functions) if rep not in gone]


def converge(view: PlatformView, placer: Placer, parallelism: Parallelism | None = None) -> Convergence:
    """The actions that move ``view`` towards every function's desired state (see the module's doc)."""
    actions = leaving(view)
    actions += resizing(view, actions)
    wanted = requests(view)
    if not wanted:
        return Convergence(tuple(actions))
    hosts = list(view.hosts)
    result = placer.place(hosts, wanted, dict(view.key_history))
    plans = start_plans(view, result, parallelism)
    actions.extend(Action("start", plan.function, plan=plan, key=placement.key, placed=placement.source)
                   for placement, plan in zip(result.placements, plans, strict=True))
    return Convergence(tuple(actions), result)


def start_plans(view: PlatformView, result: ScheduleResult, parallelism: Parallelism | None = None
                ) -> list[StartPlan]:
    """How each placement starts (`plan_starts`): a stage's holders are the hosts that cache or hold it; a
    host serving replicas sends their answers on its NIC, so chains avoid sending from it; ParaServe groups
    borrow helpers on spare hosts (a free slot, nothing placed there in this batch), quiet ones first."""
    holders: dict[str, list[str]] = {}
    for host in view.hosts:
        for function in host.cached | host.held:  # a zygote or the verified file: a peer can fetch it
            holders.setdefault(function, []).append(host.name)
    serving_hosts = [h.name for h in view.hosts if any(h.running.values())]
    busy = {(a, b.name) for a in serving_hosts for b in view.hosts if a != b.name}
    serving = {fn.name: fn.serving for fn in view.functions}
    parts: dict[str, int] = {}
    spare: list[str] = []
    if "paraserve" in view.mechanisms and parallelism is not None:
        loads = registry_loads(result.placements, holders, view.mechanisms)
        parts = {f: parallelism(f, view.hosts) for f in loads}
        placed = {p.host for p in result.placements}
        free = [h for h in view.hosts if h.gpu_free > 0 and h.name not in placed]
        spare = [h.name for h in sorted(free, key=lambda h: (sum(h.running.values()), h.name))]
    return plan_starts(result.placements, holders, view.mechanisms, serving, parts, busy, spare)


def registry_loads(placements: Sequence, holders: Mapping[str, Collection[str]], mechanisms: Collection[str]
                   ) -> list[str]:
    """Functions of ``placements`` that load from the registry (no peer to fetch from, or no peer fetch on),
    in placement order: the ones a ParaServe start may split."""
    network = bool(set(mechanisms) & {"peer", "multicast", "live"})
    out: dict[str, None] = {}
    for p in placements:
        if p.source in ("fork", "gpu"):
            continue
        if not (network and p.source == "peer" and any(h != p.host for h in holders.get(p.function, ()))):
            out[p.function] = None
    return list(out)


def _current(fn: FunctionView) -> list[ReplicaView]:
    return [r for r in fn.replicas if r.generation == fn.generation and r.state in ("starting", "ready")]
