"""How each placed replica starts (issues 16 and 17): the rule the live gateway and the simulator share. Pure.

The placer says where a replica goes and where its parameters are (`Placement.source`: fork from this
host's cache, a peer host that holds them, or cold from the registry). Which *mechanism* moves them depends
on what the cluster has switched on (``enabled``, a subset of `MECHANISMS`):

- ``fork``: the host's KeysManager forks from its cache (always, when the placer says so);
- ``peer``: one peer sends the stage to this host; several receivers on one source share its NIC (a star);
- ``multicast``: the receivers of one stage in one batch form a chain (`plan_chain`, BlitzScale §5.1);
- ``live``: a peer / chain receiver serves the layers it holds while loading, an existing replica the rest
  (BlitzScale §5.2; needs a replica of the stage that serves already);
- ``paraserve``: cold replicas of one stage fetch 1/P of it each and serve as a P-part sub-pipeline, then
  consolidate to full replicas (ParaServe §4-§6); P per function comes from `plan_parallelism`. A group with
  fewer replicas than P borrows helper workers on spare hosts (a free GPU, nothing placed there in this
  batch); a helper serves its part until the group has consolidated, then leaves (ParaServe's scaling down).

Without ``peer`` / ``multicast`` / ``live`` a placer's ``peer`` start loads from the registry (``cold``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from quart_kernel.scheduling.multicast import Link, plan_chain
from quart_kernel.scheduling.types import Placement

StartMode = Literal["gpu", "fork", "peer", "multicast", "live", "cold", "paraserve"]
MECHANISMS = ("peer", "multicast", "live", "paraserve")


@dataclass(frozen=True, slots=True)
class StartPlan:
    """One placed replica and how it starts."""

    function: str
    host: str
    mode: StartMode
    source: str | None = None  # the peer that sends the parameters (peer / multicast / live)
    position: int = 0  # 1-based place in the chain from ``source`` (multicast / live); 1 for a plain peer
    sharers: int = 1  # receivers the source's NIC serves at once (a peer star); 1 in a chain
    group: tuple[str, ...] = ()  # paraserve: the sub-pipeline's hosts in part order (helpers last)
    helpers: tuple[str, ...] = ()  # paraserve: the group's borrowed hosts (on the group's first plan only)


def check_mechanisms(enabled: Collection[str]) -> frozenset[str]:
    unknown = set(enabled) - set(MECHANISMS)
    if unknown:
        raise ValueError(f"start mechanisms: unknown {sorted(unknown)}; known: {', '.join(MECHANISMS)}")
    return frozenset(enabled)


def plan_starts(placements: Sequence[Placement], holders: Mapping[str, Collection[str]],
                enabled: Collection[str] = frozenset(), serving: Mapping[str, int] | None = None,
                parts: Mapping[str, int] | None = None,
                busy_links: Collection[Link] = frozenset(), spare_hosts: Sequence[str] = ()) -> list[StartPlan]:
    """One `StartPlan` per placement, in placement order.

    ``holders``: function → hosts that hold its parameters (peer sources); ``serving``: function → replicas
    serving now (a live start needs one); ``parts``: function → P of a ParaServe cold start (default 1,
    no split); ``busy_links``: (sender, receiver) directions with serving traffic (chains avoid them);
    ``spare_hosts``: hosts a ParaServe group may borrow helpers on, each once, in this order.
    """
    enabled = check_mechanisms(enabled)
    serving = serving or {}
    parts = parts or {}
    network = bool(enabled & {"peer", "multicast", "live"})
    plans: list[StartPlan | None] = [None] * len(placements)
    spare = [h for h in dict.fromkeys(spare_hosts) if h not in {p.host for p in placements}]
    by_fn: dict[str, dict[str, list[int]]] = {}
    for i, p in enumerate(placements):
        if p.source in ("fork", "gpu"):
            plans[i] = StartPlan(p.function, p.host, p.source)
            continue
        sources = [h for h in holders.get(p.function, ()) if h != p.host]
        kind = "peer" if p.source == "peer" and network and sources else "cold"
        by_fn.setdefault(p.function, {}).setdefault(kind, []).append(i)
    for function, kinds in sorted(by_fn.items()):
        for i, plan in _network_starts(placements, kinds.get("peer", []), holders.get(function, ()), enabled,
                                       serving.get(function, 0) > 0, busy_links):
            plans[i] = plan
        for i, plan in _cold_starts(placements, kinds.get("cold", []), enabled, parts.get(function, 1), spare):
            plans[i] = plan
    return [p for p in plans if p is not None]


def _network_starts(placements: Sequence[Placement], indices: list[int], holders: Collection[str],
                    enabled: frozenset[str], live: bool, busy_links: Collection[Link]):
    if not indices:
        return
    function = placements[indices[0]].function
    receivers = [placements[i].host for i in indices]
    sources = sorted(set(holders) - set(receivers)) or sorted(set(holders))
    mode: StartMode = "live" if "live" in enabled and live else (
        "multicast" if "multicast" in enabled and len(indices) > 1 else "peer")
    if "multicast" in enabled or mode == "live":
        # One chain per source (multi-chain, BlitzScale §5.1): receivers dealt round-robin in name order.
        groups: dict[str, list[str]] = {}
        for n, host in enumerate(sorted(set(receivers))):
            groups.setdefault(sources[n % len(sources)], []).append(host)
        where: dict[str, tuple[str, int]] = {}
        for source, group in groups.items():
            chain = plan_chain([source], group, busy_links)
            for pos, host in enumerate(chain[1:], start=1):
                where[host] = (source, pos)
        seen: dict[str, int] = {}
        for i in indices:
            host = placements[i].host
            source, pos = where[host]
            pos += seen.get(host, 0)  # a second replica on one host comes after the first
            seen[host] = seen.get(host, 0) + 1
            yield i, StartPlan(function, host, mode, source, pos)
        return
    # Plain peer fetch: each receiver pulls from one source; receivers on one source share its NIC.
    assigned = {i: sources[n % len(sources)] for n, i in enumerate(indices)}
    load: dict[str, int] = {}
    for source in assigned.values():
        load[source] = load.get(source, 0) + 1
    for i in indices:
        yield i, StartPlan(function, placements[i].host, "peer", assigned[i], 1, load[assigned[i]])


def _cold_starts(placements: Sequence[Placement], indices: list[int], enabled: frozenset[str], parts: int,
                 spare: list[str]):
    if not indices:
        return
    function = placements[indices[0]].function
    if "paraserve" not in enabled or parts < 2:
        for i in indices:
            yield i, StartPlan(function, placements[i].host, "cold")
        return
    # Groups of P replicas on distinct hosts; a smaller group borrows helpers from ``spare`` (consumed); a
    # group that stays alone starts cold.
    pending = list(indices)
    while pending:
        group: list[int] = []
        hosts: set[str] = set()
        for i in list(pending):
            if placements[i].host not in hosts:
                group.append(i)
                hosts.add(placements[i].host)
                pending.remove(i)
            if len(group) == parts:
                break
        helpers = tuple(spare[:max(0, parts - len(group))])
        del spare[:len(helpers)]
        if len(group) + len(helpers) < 2:
            for i in group:
                yield i, StartPlan(function, placements[i].host, "cold")
            continue
        names = tuple(placements[i].host for i in group) + helpers
        for n, i in enumerate(group):
            yield i, StartPlan(function, placements[i].host, "paraserve", group=names,
                               helpers=helpers if n == 0 else ())


def chains_of(plans: Sequence[StartPlan]) -> list[tuple[str, tuple[str, ...]]]:
    """The chains to order before the starts: ``(function, (source, r1, r2, ...))`` for every source whose
    multicast / live receivers are two or more hosts (one receiver just fetches from its source)."""
    receivers: dict[tuple[str, str], dict[str, int]] = {}
    for plan in plans:
        if plan.mode in ("multicast", "live") and plan.source is not None:
            hosts = receivers.setdefault((plan.function, plan.source), {})
            hosts[plan.host] = min(hosts.get(plan.host, plan.position), plan.position)
    return [(function, (source, *sorted(hosts, key=hosts.__getitem__)))
            for (function, source), hosts in sorted(receivers.items()) if len(hosts) > 1]


def peers_of(plan: StartPlan, chains: Sequence[tuple[str, tuple[str, ...]]]) -> tuple[str, ...]:
    """The hosts ``plan``'s start fetches from, in order (then the registry): its predecessor in its chain and
    the chain's source, or its one peer; none for fork, cold and paraserve starts."""
    if plan.source is None or plan.mode not in ("peer", "multicast", "live"):
        return ()
    for function, chain in chains:
        if function == plan.function and chain[0] == plan.source and plan.host in chain[1:]:
            prev = chain[chain.index(plan.host, 1) - 1]
            return tuple(dict.fromkeys((prev, plan.source)))
    return (plan.source,)
