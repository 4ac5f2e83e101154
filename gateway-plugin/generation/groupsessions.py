"""Generation sessions on a ParaServe group, and their consolidation by KV-cache migration (ParaServe §4, §6.2).

A cold stage started by ParaServe is served at first by P part replicas on P hosts, part i running the layers
``[a_i, b_i)`` the gateway gave it (its ``part``; it answers 503 for them until their bytes have arrived, then
serves them) and fetching the rest of the stage until it is whole. While the stage has no whole replica, a new
session at that stage opens on a **chain** of parts that tiles the stage (`chain_for`): every step passes
through the parts in order, each keeping the session's KV cache of its own layers, booked its share of the
session's positions (`quart_stage.spans.kv_charge`, the rule the stage's own table charges). Every part of a chain
at the session's last stage gets its sample (a part the head's layers may move onto keeps the session's seed).

**Consolidation.** Before each step of a chained session, the engine looks for a ready whole replica of the
stage with room (a member of the chain first: it holds a part of the cache already). When there is one, the
session's caches of the other parts are gathered onto it (`gateway_plugin.generation.kvmove.move_kv`:
``GET /_/sessions/<id>/kv`` from each part, ``PUT`` on the whole replica, every tensor's sha256 and length
checked before anything changes there), the parts free their copies, and the stream's next step runs the whole
stage there from the positions it holds: no re-prefill. A few sessions move at once (each stream pauses for its
own move only). A migration that fails (a part gone, a refused install) falls back to a replay on the whole
replica (prompt + generated at position 0 under a new id: the same tokens) and is counted in ``reprefills``.

How many of the group's workers stay once all are whole is the gateway's desired count (the sliding-window rule,
`quart_kernel.scheduling.paraserve_gen.workers_to_keep`, from :meth:`GroupChains.demand`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import aiohttp
from gateway_plugin import layers
from gateway_plugin.generation.kvmove import Hop, StepError, install_kv, move_kv
from gateway_plugin.generation.session import Chain, Session, SessionHost
from quart_kernel.picking import pick
from quart_kernel.scheduling.paraserve_gen import GroupDemand
from quart_stage.spans import kv_charge

log = logging.getLogger("quart.generation")

MIGRATING_AT_ONCE = 2  # sessions whose caches move at the same time (the others keep decoding on the group)
ARRIVALS_KEPT = 4096  # session arrival times kept per stage function (the sliding window reads the recent ones)


def part_span(replica: Any) -> layers.Range | None:
    """The layers a part replica serves sessions for: its ParaServe part (given at its start; answered 503 until
    held), else what it holds now; None for a whole replica."""
    if layers.is_whole(replica):
        return None
    return replica.part or layers.held_range(replica)


def chain_for(ready: Iterable[Any], need: int, room: Callable[[str], int], excluded: Iterable[str] = ()
              ) -> Chain | None:
    """Part replicas that run a stage in order for a session of ``need`` positions, each with room for its
    share: from the stage's first layer, the part that reaches furthest (then the provider's pick rule); None
    when the parts do not tile the stage."""
    skip = set(excluded)
    parts = [r for r in ready if r.id not in skip and layers.stage_range(r) is not None and part_span(r)]
    if not parts:
        return None
    stage = layers.stage_range(parts[0])
    pos, hops, charges = stage[0], [], []
    while pos < stage[1]:
        fits = []
        for r in parts:
            a, b = part_span(r)
            span = (pos, min(b, stage[1]))
            if a <= pos < b and r not in [h for h, _ in hops] and room(r.id) >= kv_charge(need, span, stage):
                fits.append((r, span))
        if not fits:
            return None
        reach = max(span[1] for _, span in fits)
        chosen = pick([r for r, span in fits if span[1] == reach], 0)
        hops.append((chosen, (pos, reach)))
        charges.append(kv_charge(need, (pos, reach), stage))
        pos = reach
    return Chain(hops, charges)


def unchained(placed: list[Any]) -> tuple[list[Any], dict[int, Chain]]:
    """A new session's stages as placed: (the replica of each stage, None where a `Chain` runs it; the chains)."""
    chains = {k: c for k, c in enumerate(placed) if isinstance(c, Chain)}
    return [None if k in chains else r for k, r in enumerate(placed)], chains


class GroupChains:
    """The sessions run on ParaServe groups' parts, for a :class:`~gateway_plugin.generation.session.SessionHost`
    (the session engine): their consolidations so far, and the stage functions' session arrivals and waiters (what
    the sliding-window rule reads, :meth:`demand`)."""

    def __init__(self, host: SessionHost) -> None:
        self.host = host
        self.migrations = 0  # sessions whose KV caches moved from a group's parts onto a whole replica
        self.reprefills = 0  # ... whose move failed and that replayed there instead
        self.kv_moved_bytes = 0
        self.migration_s = 0.0  # seconds the moves took, summed over sessions
        self._moving = asyncio.Semaphore(MIGRATING_AT_ONCE)
        self._arrivals: dict[str, deque[float]] = {}  # stage function -> session arrival times
        self._waiting: dict[str, int] = {}  # stage function -> sessions waiting for a replica of it
        self._needs: dict[str, deque[int]] = {}  # stage function -> recent sessions' positions

    def chain_for(self, function: str, need: int, excluded: Iterable[str]) -> Chain | None:
        return chain_for(self.host.source.ready(function), need, self.host.book.room, excluded)

    def unchain(self, session: Session, k: int, keep: Any = None, free: bool = True) -> None:
        """Stage ``k`` no longer runs on its chain: its shares released and (``free``) the session's cache freed
        on every part but ``keep`` (the whole replica it migrated to)."""
        chain = session.chains.pop(k)
        self.host.book.release_all(chain.bookings())
        for r in chain.members() if free else ():
            if r is not keep:
                self.host.forget(r, session.id)

    def noted(self, stages: Iterable[str], need: int) -> None:
        """A session arrived for ``stages`` (the sliding window counts it)."""
        now = self.host.clock()
        for fn in stages:
            self._arrivals.setdefault(fn, deque(maxlen=ARRIVALS_KEPT)).append(now)
            self._needs.setdefault(fn, deque(maxlen=64)).append(need)

    @contextlib.contextmanager
    def waiting_for(self, function: str) -> Iterator[None]:
        """A session waits for a ready replica of ``function`` while in this block (the sliding window counts it)."""
        self._waiting[function] = self._waiting.get(function, 0) + 1
        try:
            yield
        finally:
            self._waiting[function] -= 1

    def demand(self, function: str) -> GroupDemand:
        """What the sliding-window rule reads of a stage function: its sessions' arrival times, the ones waiting
        for a replica now (none ready, or every ready one without room: the entry's line), and how many sessions a
        whole replica holds (its KV cap / the recent sessions' positions)."""
        book = self.host.book
        needs = self._needs.get(function) or [1]
        caps = [book.cap(r.id) for r in _whole(self.host.source.ready(function))] or [book.default_cap]
        per_worker = max(1, min(caps) // max(1, round(sum(needs) / len(needs))))
        waiting = self._waiting.get(function, 0) + self.host.room.waiting(function)
        return GroupDemand(tuple(self._arrivals.get(function, ())), waiting, per_worker)

    # ------------------------------------------------------------------ steps on a chain

    async def part_call(self, call: Callable[[], Awaitable[tuple[int, bytes, dict[str, str]]]]
                        ) -> tuple[int, bytes, dict[str, str]]:
        """A step's ``call()`` to one part of a chain; a part that does not hold its layers yet answers 503 (nothing
        changed there) and is asked again, for up to ``replica_wait_s``."""
        deadline = self.host.clock() + self.host.config.replica_wait_s
        while True:
            status, data, answer = await call()
            if status != 503 or self.host.clock() >= deadline:
                return status, data, answer
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ consolidation

    async def consolidate(self, session: Session) -> None:
        """Before a step: move each chained stage of ``session`` whose stage has a whole replica with room onto it."""
        for k in list(session.chains):
            if self._whole_for(session, k) is None:
                continue
            async with self._moving:  # chosen when its turn comes, with the bookings of the moves before it
                target = self._whole_for(session, k)
                if target is not None:
                    await self._migrate(session, k, target)

    def _whole_for(self, session: Session, k: int) -> Any:
        """A ready whole replica of stage ``k`` with room for the session: a member of its chain first (it holds
        a part of the cache, booked already), else the book's choice; None when there is none yet."""
        book, chain = self.host.book, session.chains[k]
        whole = [r for r in _whole(self.host.source.ready(session.stages[k])) if r.state == "ready"]
        held = {r.id: n for r, n in chain.bookings()}
        members = [r for r in whole if r.id in held and book.room(r.id) + held[r.id] >= session.need]
        if members:  # the least booked: a group that became several whole workers shares its sessions out
            return min(members, key=lambda r: book.booked(r.id) - held[r.id])
        return book.choose([r for r in whole if r.id not in held], session.need)

    async def _migrate(self, session: Session, k: int, target: Any) -> None:
        """Gather the session's caches of stage ``k`` onto ``target`` (verified there), or replay it there."""
        host, chain = self.host, session.chains[k]
        moves = [Hop(r.url, span) for r, span in chain.hops if r is not target]
        whole, timeout = Hop(target.url), aiohttp.ClientTimeout(total=host.config.step_timeout_s)
        moved, failure, t0 = 0, None, host.clock()
        host.book.reserve(target.id, session.need)  # now: a move beside it sees this one's booking
        try:
            if session.fed > 0:
                if target not in chain.members():  # the first install makes the session there; the rest add layers
                    moved += await move_kv(host.client(), session.id, session.fed, session.need, moves.pop(0), whole,
                                           timeout, self.install_part)
                sizes = await asyncio.gather(*(move_kv(host.client(), session.id, session.fed, session.need, hop,
                                                       whole, timeout, self.install_part) for hop in moves))
                moved += sum(sizes)
        except (StepError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        self.migration_s += host.clock() - t0
        if failure is None:
            self.unchain(session, k, keep=target)
            session.replicas[k] = target
            self.migrations += 1
            self.kv_moved_bytes += moved
            log.info("session %s: stage %s consolidated onto %s (%d KV bytes moved)", session.id,
                     session.stages[k], target.id, moved)
            return
        log.warning("session %s: moving its KV cache onto %s failed (%s); replaying there", session.id, target.id,
                    failure)
        host.book.release(target.id, session.need)
        host.drop(session)  # the old id everywhere, the chain's parts included
        if target not in chain.members():
            host.forget(target, session.id)  # what of the move arrived there
        self.unchain(session, k, free=False)
        host.rehome(session, k, target)
        session.reprefills += 1
        self.reprefills += 1

    async def install_part(self, session_id: str, fed: int, reserve: int, whole: Hop, data: bytes) -> None:
        """Install one exported part on the whole replica (tests wrap it to corrupt the bytes in transit)."""
        await install_kv(self.host.client(), session_id, fed, reserve, whole, data,
                         aiohttp.ClientTimeout(total=self.host.config.step_timeout_s))


def _whole(replicas: Iterable[Any]) -> list[Any]:
    return [r for r in replicas if layers.is_whole(r)]
