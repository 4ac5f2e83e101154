"""Chain multicast planning (BlitzScale §5.1, serial forwarding): one stage to several hosts at once.

A chain ``[source, r1, r2, ...]`` sends the stage once: the source streams it to r1, and each receiver
forwards every chunk to the next while it writes it, so the last host is ready after about one transfer plus
one chunk time per hop, however many receivers there are. Pure.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

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

