"""Generation sessions during a live scale-up: cooperative execution, then the rejoin (BlitzScale §4, with decode).

While a new replica of a stage is still receiving its parameters it serves the layers that have arrived
(``gateway_plugin.layers``). A session opened then is **split** at that stage: the partial replica runs the
stage's first layers ``[S, cut)``, a whole replica the rest ``[cut, E)``; each keeps the session's KV cache for
the layers it ran (the stage protocol's ``X-Quart-Layers`` with ``X-Quart-Session``), and every later step —
decode included — goes the same two ways, so the new replica takes its share of the burst from its first layers
on. The cut is fixed for the session's life (a replica's cache covers the layers it ran, no others).

When the partial replica is whole, the session **rejoins** it: it runs the whole stage there and the whole
replica it shared is relieved. How (``QUART_GEN_REJOIN``):

- ``shadow`` (default): a background replay. The session's tokens so far are prefilled under a new session id
  through the stages, with the now-whole replica at the split stage, while the session keeps decoding split;
  the replay's answer must equal the token the session already has (checked). At the next step the session
  switches to the new id: that step carries the tokens generated meanwhile (a short catch-up at the position
  the replay reached), the old id is deleted everywhere. No KV bytes cross the network and the stream never
  waits for a re-prefill.
- ``replay``: the session moves at once by the engine's replay (a new id, prompt + tokens at Pos 0): simple,
  but that step waits for a whole prefill of the context (measured in docs/benchmarks.md).
- ``keep``: the session stays split until it ends.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from gateway_plugin import layers
from quart_kernel.picking import pick
from quart_stage.spans import kv_charge

log = logging.getLogger("quart.generation")

REJOIN_MODES = ("shadow", "replay", "keep")


@dataclass
class Split:
    """A session's stage run in two parts: ``partial`` runs ``part``, the session's whole replica ``rest``."""

    partial: Any
    part: layers.Range
    rest: layers.Range
    part_tokens: int = 0  # KV positions booked on the live replica: its part's share + the whole, for the rejoin
    rest_tokens: int = 0  # ... and on the whole replica
    shadow: Any = None  # the background replay's Session, while it runs or until the switch
    task: asyncio.Task | None = None
    base: str = ""  # the session id the replay was started from (a failover in between makes it stale)
    given_up: bool = False  # the replay failed: the session stays split
    extra: list = field(default_factory=list)  # (replica, positions) the replay booked beyond the session's own


def bookings(session: Any) -> list[tuple[Any, int]]:
    """What the session holds booked: (replica, positions) for every stage, a split's two parts each their share."""
    out = []
    for k, replica in enumerate(session.replicas):
        split, chain = session.splits.get(k), session.chains.get(k)
        if chain is not None:
            out += chain.bookings()
        elif split is None:
            out.append((replica, session.need))
        else:
            out += [(replica, split.rest_tokens), (split.partial, split.part_tokens)]
    return [(r, n) for r, n in out if r is not None]


def split_for(ready: list[Any], room: Any, need: int) -> Split | None:
    """The split a new session takes at a stage: on a live replica that holds the stage's first layers (not yet
    all) and has room for ``need`` positions (``room(replica_id)``); the one holding most, then the provider's
    pick rule. None when there is none."""
    fits = []
    for r in ready:
        stage, held = layers.stage_range(r), getattr(r, "held", None)
        if stage is None or held is None or layers.is_whole(r):
            continue
        if held[0] == stage[0] < held[1] < stage[1] and room(r.id) >= need + kv_charge(need, (stage[0], held[1]), stage):
            fits.append(r)
    if not fits:
        return None
    most = max(layers.held_range(r)[1] for r in fits)
    partial = pick([r for r in fits if layers.held_range(r)[1] == most], 0)
    stage, cut = layers.stage_range(partial), layers.held_range(partial)[1]
    part, rest = (stage[0], cut), (cut, stage[1])
    # the live replica is booked its part's share (spans.kv_charge) and the whole session beside it: the room its
    # rejoin's replay takes while the part is still held, which a burst of new sessions can never take
    return Split(partial, part, rest, need + kv_charge(need, part, stage), kv_charge(need, rest, stage))


class CooperativeSessions:
    """The split and rejoin half of :class:`gateway_plugin.generation.sessions.SessionEngine` (a mixin: it uses the
    engine's ``book``, ``config``, ``source``, ``active``, ``_step`` and ``_drop``)."""

    def _split_for(self, fn: str, need: int) -> Split | None:
        """At a session's entry: the split of stage ``fn`` with a live replica serving its first layers, if any."""
        return split_for(self.source.ready(fn), self.book.room, need)

    def _reserve_stage(self, replica: Any, need: int, split: Split | None, release: bool = False) -> None:
        """Book (or release) one stage of a new session: the whole replica ``need`` positions, or its share of a
        split and the live replica the rest."""
        change = self.book.release if release else self.book.reserve
        if hasattr(replica, "bookings"):  # a ParaServe chain (groupsessions.Chain): each part its share
            for r, n in replica.bookings():
                change(r.id, n)
        elif split is None:
            change(replica.id, need)
        else:
            change(replica.id, split.rest_tokens)
            change(split.partial.id, split.part_tokens)

    def _reserve(self, session: Any) -> None:
        for replica, n in bookings(session):
            self.book.reserve(replica.id, n)

    def _release(self, session: Any) -> None:
        for replica, n in bookings(session):
            self.book.release(replica.id, n)

    def calls(self, session: Any, k: int) -> list[tuple[Any, layers.Range | None]]:
        """The replica calls of stage ``k`` of a step: (replica, its layers or None for the whole stage)."""
        split, chain = session.splits.get(k), session.chains.get(k)
        if chain is not None:
            return list(chain.hops)
        if split is None:
            return [(session.replicas[k], None)]
        return [(split.partial, split.part), (session.replicas[k], split.rest)]

    def partials(self, session: Any) -> list[Any]:
        """The part replicas a session holds caches on besides its whole ones (splits' live parts, chains' parts)."""
        return [s.partial for s in session.splits.values()] + [r for c in session.chains.values() for r in c.members()]

    # ------------------------------------------------------------------ rejoin

    async def _rejoin(self, session: Any) -> None:
        """Before a step: move each split whose partial replica is now whole onto it, as ``QUART_GEN_REJOIN`` says."""
        for k, split in list(session.splits.items()):
            if split.task is not None and split.task.done():
                await self._switch(session, k, split)
                continue
            if not layers.is_whole(split.partial) or split.given_up or split.task is not None:
                continue
            if getattr(split.partial, "state", "ready") != "ready" or self.config.rejoin == "keep":
                continue
            if session.fed == 0 or self.config.rejoin == "replay":  # nothing held yet, or move by replay now
                if self.book.room(split.partial.id) + split.part_tokens >= session.need:
                    self._unsplit(session, k, onto_partial=True)
                continue
            if all(self.book.room(r.id) >= n for r, n in self._extra(session, self._shadow_of(session, k))):
                self._start_shadow(session, k, split)  # else: no room for it yet, try at the next step

    def _shadow_of(self, session: Any, k: int) -> Any:
        """The session as it will be after the rejoin of stage ``k``: a new id, the now-whole replica there."""
        replicas = list(session.replicas)
        replicas[k] = session.splits[k].partial
        return replace(session, id=uuid.uuid4().hex, replicas=replicas,
                       splits={j: replace(s, shadow=None, task=None) for j, s in session.splits.items() if j != k},
                       chains=dict(session.chains),
                       generated=[], fed=0)

    @staticmethod
    def _extra(session: Any, shadow: Any) -> list[tuple[Any, int]]:
        """What the background replay books beyond the session's own bookings, replica by replica (the live
        replica already holds the room: nothing there)."""
        have: dict[str, int] = {}
        for r, n in bookings(session):
            have[r.id] = have.get(r.id, 0) + n
        out = []
        for r, n in bookings(shadow):
            more = n - have.get(r.id, 0)
            have[r.id] = max(0, have.get(r.id, 0) - n)
            if more > 0:
                out.append((r, more))
        return out

    def _start_shadow(self, session: Any, k: int, split: Split) -> None:
        n = session.fed
        sequence = session.prompt + session.generated
        shadow = self._shadow_of(session, k)
        split.extra = self._extra(session, shadow)
        for r, n in split.extra:
            self.book.reserve(r.id, n)
        split.shadow, split.base = shadow, session.id
        self.shadows += 1

        async def run() -> bool:
            token = await self._step(shadow, sequence[:n], 0, False)
            if token != sequence[n]:
                log.warning("session %s: the rejoin replay answered token %d, the session has %d: staying split",
                            session.id, token, sequence[n])
                return False
            shadow.fed = n
            return True

        split.task = asyncio.get_running_loop().create_task(run())

    async def _switch(self, session: Any, k: int, split: Split) -> None:
        """The background replay is done: take its id and replicas (the next step catches up), or stay split."""
        ok = False
        try:
            ok = split.task.result() and split.base == session.id
        except Exception as exc:  # noqa: BLE001 - the replay failed: the session stays split, as it was
            log.warning("session %s: the rejoin replay failed (%s); staying split", session.id, exc)
        if not ok:
            split.given_up = True
            self._discard_shadow(split)
            return
        shadow = split.shadow
        split.task = split.shadow = None
        self._drop(session)  # the old id on every replica, the split's two parts included
        for r, n in split.extra:  # the replay's extra bookings become the session's: book what it holds now
            self.book.release(r.id, n)
        self._release(session)
        self._reserve(shadow)
        self.active.pop(session.id, None)
        session.id, session.replicas, session.splits, session.fed = shadow.id, shadow.replicas, shadow.splits, shadow.fed
        self.active[session.id] = session
        session.rejoins += 1
        self.rejoins += 1
        log.info("session %s: rejoined stage %s on %s (background replay of %d positions)", session.id,
                 session.stages[k], split.partial.id, shadow.fed)

    def _unsplit(self, session: Any, k: int, onto_partial: bool) -> None:
        """End the split of stage ``k`` now: the stage runs whole on the partial replica (``onto_partial``, it is
        whole) or on the session's whole replica; the session replays from Pos 0 under a new id."""
        split = session.splits.get(k)
        if split is None:
            return
        self._discard_shadow(split)
        self._drop(session)
        self._release(session)
        del session.splits[k]
        if onto_partial:
            session.replicas[k] = split.partial
            session.rejoins += 1
            self.rejoins += 1
        self._reserve(session)
        self.active.pop(session.id, None)
        session.id, session.fed = uuid.uuid4().hex, 0
        self.active[session.id] = session

    def _discard_shadow(self, split: Split) -> None:
        """Stop a background replay and free what it holds (its id on every replica, its bookings)."""
        shadow, task = split.shadow, split.task
        split.shadow = split.task = None
        if task is not None and not task.done():
            task.cancel()
        if shadow is not None:
            self._drop(shadow)
            for r, n in split.extra:
                self.book.release(r.id, n)
        split.extra = []

    def _end_splits(self, session: Any) -> None:
        """The session ended: stop its background replays (its own ids are freed by the engine)."""
        for split in session.splits.values():
            self._discard_shadow(split)
