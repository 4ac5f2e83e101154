"""Chain multicast planning (BlitzScale §5.1, serial forwarding): one stage to several hosts at once.

A chain ``[source, r1, r2, ...]`` sends the stage once: the source streams it to r1, and each receiver
forwards every chunk to the next while it writes it, so the last host is ready after about one transfer plus
one chunk time per hop, however many receivers there are. Pure.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from quart_provider.scheduling.types import Placement

Link = tuple[str, str]  # (sender, receiver): traffic on this direction of the pair


def plan_chain(holders: Iterable[str], receivers: Iterable[str],
               busy_links: Collection[Link] = frozenset()) -> list[str | None]:
    """``[source, r1, r2, ...]``: every receiver once, in the order the stage flows.

    ``holders`` hold the stage (a source candidate each); ``receivers`` need it (a holder among them needs
    nothing and is left out); ``busy_links`` are (sender, receiver) directions that carry serving traffic
    (a pipeline's activations, a KV-cache transfer). The plan has as few busy hops as it can (greedy: each
    hop prefers a receiver reached on a quiet link, then the name order); ties between sources go to the
    first by name. Links are directional, as NICs are full duplex: a busy a → b does not make b → a busy.
    No holder: the source is ``None`` (the first receiver fetches from the registry).
    """
    sources = sorted(set(holders))
    pending = sorted(set(receivers) - set(sources))
    busy = set(busy_links)
    if not pending:
        return [sources[0] if sources else None]
    best: tuple[int, list[str | None]] | None = None
    for source in sources or [None]:
        chain: list[str | None] = [source]
        left = list(pending)
        while left:
            tail = chain[-1]
            nxt = next((r for r in left if (tail, r) not in busy), left[0])
            chain.append(nxt)
            left.remove(nxt)
        cost = chain_busy_hops(chain, busy)
        if best is None or cost < best[0]:
            best = (cost, chain)
    return best[1]


def chain_busy_hops(chain: list[str | None], busy_links: Collection[Link]) -> int:
    """How many hops of ``chain`` run on a busy link."""
    return sum((a, b) in set(busy_links) for a, b in zip(chain, chain[1:], strict=False) if a is not None)


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """Where the new replicas of one stage get its bytes (hosts by name): ``chain`` when several hosts need it at
    once (multicast it first), and per receiving host the peers to fetch from, in order (then the registry)."""

    function: str
    chain: tuple[str | None, ...] = ()
    peers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def plan_fetches(placements: Iterable[Placement], holders: Mapping[str, Collection[str]],
                 busy_links: Collection[Link] = frozenset()) -> list[FetchPlan]:
    """One :class:`FetchPlan` per stage that some placement must fetch (source ``peer`` or ``cold``).

    ``holders``: function → hosts that hold its parameters now. One receiver fetches from the holders (a
    quiet link first); two or more are served by one chain (:func:`plan_chain`): each fetches from its
    predecessor, falling back to the chain's source."""
    receivers: dict[str, list[str]] = {}
    for p in placements:
        if p.source in ("peer", "cold") and p.host not in receivers.setdefault(p.function, []):
            receivers[p.function].append(p.host)
    plans = []
    busy = set(busy_links)
    for function, hosts in sorted(receivers.items()):
        have = sorted(set(holders.get(function, ())) - set(hosts))
        if len(hosts) == 1:
            host = hosts[0]
            plans.append(FetchPlan(function, peers={host: tuple(sorted(have, key=lambda h: (h, host) in busy))}))
            continue
        chain = plan_chain(have, hosts, busy)
        peers = {host: tuple(dict.fromkeys(h for h in (prev, chain[0]) if h is not None))
                 for prev, host in zip(chain, chain[1:], strict=False)}
        plans.append(FetchPlan(function, tuple(chain), peers))
    return plans
