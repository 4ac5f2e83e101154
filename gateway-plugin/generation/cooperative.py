"""Generation sessions during a live scale-up: cooperative execution, then the rejoin (BlitzScale §4, with decode).

While a new replica of a stage is still receiving its parameters it serves the layers that have arrived
(``gateway_plugin.layers``). A session opened then is **split** at that stage: the partial replica runs the
stage's first layers ``[S, cut)``, a whole replica the rest ``[cut, E)``; each keeps the session's KV cache for
the layers it ran (the stage protocol's ``X-Quart-Layers`` with ``X-Quart-Session``), and every later step —
decode included — goes the same two ways, so the new replica takes its share of the burst from its first layers
on. The cut is fixed for the session's life (a replica's cache covers the layers it ran, no others).

**Booking** (``quart_kernel.scheduling.live_split``): each part is booked its share of the session's positions;
the live replica also holds the room the session's rejoin will need there, but only for a session predicted to
still run when the replica is whole (its steps left × the step time seen, against the layers left at the rate
they have been arriving). So the splits that end during the loading use the new replica's whole cache, and the
ones that outlive it are sure of their rejoin.

When the partial replica is whole, the session **rejoins** it: it runs the whole stage there and the whole
replica it shared is relieved. How (``QUART_GEN_REJOIN``):

- ``auto`` (default): ``shadow`` where the live replica has room for the replay beside what the split holds, else
  ``migrate`` (whose room the booking holds): the stream waits for a move only when nothing else fits.
- ``migrate``: between two steps, the whole replica's part of the cache (``GET /_/sessions/<id>/kv
  ?layers=cut-E``, safetensors with each tensor's sha256) is installed into the session on the now-whole replica
  (``PUT``, verified before anything changes), under the same id; the whole replica drops it (its share is
  released once that DELETE is answered). The stream waits for one move (the bytes of the rest's layers), never
  for a prefill; a refused move leaves the session split.
- ``shadow``: a background replay. The session's tokens so far are prefilled under a new session id through the
  stages, with the now-whole replica at the split stage, while the session keeps decoding split; the replay's
  answer must equal the token the session already has (checked). At the next step the session switches to the
  new id with a short catch-up. No KV bytes cross the network, but the replay holds the whole session beside its
  part on the new replica and costs a prefill there.
- ``replay``: the session moves at once by the engine's replay (a new id, prompt + tokens at Pos 0): simple,
  but that step waits for a whole prefill of the context.
- ``keep``: the session stays split until it ends.

Measured against each other in docs/benchmarks.md (BlitzScale, generation).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from gateway_plugin import layers
from gateway_plugin.generation.kvmove import Hop, StepError, move_kv
from quart_kernel.picking import pick
from quart_kernel.scheduling.live_split import (
    REJOIN_MODES,
    loading_left_s,
    outlives_loading,
    split_booking,
)

log = logging.getLogger("quart.generation")

__all__ = ["REJOIN_MODES", "CooperativeSessions", "Split", "bookings", "split_for"]


@dataclass
class Split:
    """A session's stage run in two parts: ``partial`` runs ``part``, the session's whole replica ``rest``."""

    partial: Any
    part: layers.Range
    rest: layers.Range
    part_tokens: int = 0  # KV positions booked on the live replica: its part's share + ``reserve``
    rest_tokens: int = 0  # ... and on the whole replica
    reserve: int = 0  # the part of ``part_tokens`` held for the rejoin (live_split.split_booking)
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


def split_for(ready: list[Any], room: Callable[[str], int], need: int, rejoin: str,
              outlives: Callable[[Any], bool]) -> Split | None:
    """The split a new session takes at a stage: on a live replica that holds the stage's first layers (not yet
    all) and has room for its booking (``room(replica_id)``; the rejoin's room too when ``outlives(replica)``);
    the one holding most, then the provider's pick rule. None when there is none."""
    fits = []
    for r in ready:
        stage, held = layers.stage_range(r), getattr(r, "held", None)
        if stage is None or held is None or layers.is_whole(r):
            continue
        if held[0] == stage[0] < held[1] < stage[1]:
            booking = split_booking(need, (stage[0], held[1]), stage, rejoin, outlives(r))
            if room(r.id) >= booking.live:
                fits.append((r, booking))
    if not fits:
        return None
    most = max(layers.held_range(r)[1] for r, _ in fits)
    partial = pick([r for r, _ in fits if layers.held_range(r)[1] == most], 0)
    booking = next(b for r, b in fits if r is partial)
    stage, cut = layers.stage_range(partial), layers.held_range(partial)[1]
    return Split(partial, (stage[0], cut), (cut, stage[1]), booking.live, booking.rest, booking.reserve)


@dataclass
class LayerArrivals:
    """When a live replica's held layers were first and last seen to grow (the rate they arrive at)."""

    first_at: float
    first_held: int
    last_at: float
    last_held: int

    def see(self, now: float, held: int) -> None:
        if held > self.last_held:
            self.last_at, self.last_held = now, held

    def rate(self) -> float | None:
        """Layers per second so far; None before a second observation of growth."""
        span = self.last_at - self.first_at
        return (self.last_held - self.first_held) / span if span > 0 and self.last_held > self.first_held else None


class CooperativeSessions:
    """The split and rejoin half of :class:`gateway_plugin.generation.sessions.SessionEngine` (a mixin: it uses the
    engine's ``book``, ``config``, ``source``, ``clock``, ``active``, ``_background``, ``_client``, ``_step`` and
    ``_drop``)."""

    arrivals: dict[str, LayerArrivals]  # live replica id -> how its layers arrive
    step_s: float | None  # the decode steps' moving average, seconds
    moved: list[tuple[int, float]]  # each migrate rejoin: (KV bytes moved, seconds the stream waited)
    replayed: list[tuple[int, float]]  # each shadow rejoin's replay: (positions, seconds it ran beside the stream)

    def _init_cooperative(self) -> None:
        self.arrivals, self.step_s, self.moved, self.replayed = {}, None, [], []

    def _forget(self, replica: Any, session_id: str, then: Callable[[], None] | None = None) -> None:
        """``DELETE /_/sessions/<id>`` on one replica, in the background (the engine's freeing uses it too);
        ``then()`` once it is answered (or failed)."""
        task = asyncio.get_running_loop().create_task(self._delete(replica, session_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if then is not None:
            task.add_done_callback(lambda _: then())

    async def _delete(self, replica: Any, session_id: str) -> None:
        url = f"{replica.url.rstrip('/')}/_/sessions/{session_id}"
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with self._client().delete(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()

    def _split_for(self, fn: str, need: int, steps: int) -> Split | None:
        """At a session's entry (``steps`` steps to run): the split of stage ``fn`` with a live replica serving its
        first layers, if any."""
        return split_for(self.source.ready(fn), self.book.room, need, self.config.rejoin,
                         lambda r: self._outlives(r, steps))

    def _outlives(self, replica: Any, steps: int) -> bool:
        """Whether a session of ``steps`` steps opened now will still run when ``replica`` is whole."""
        stage, held = layers.stage_range(replica), layers.held_range(replica)
        now = self.clock()
        seen = self.arrivals.setdefault(replica.id, LayerArrivals(now, held[1], now, held[1]))
        seen.see(now, held[1])
        left = loading_left_s(held[1] - stage[0], stage[1] - stage[0], seen.rate())
        return outlives_loading(steps, self.step_s, left)

    def _note_step(self, seconds: float, decode: bool) -> None:
        """A step's duration; a decode step's goes into the moving average the outlive prediction uses."""
        if decode:
            self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

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
            shadow_fits = self.config.rejoin in ("shadow", "auto") and all(
                self.book.room(r.id) >= n for r, n in self._extra(session, k, self._shadow_of(session, k)))
            if shadow_fits:  # the background replay: the stream never waits
                self._start_shadow(session, k, split)
            elif self.config.rejoin in ("migrate", "auto") and (
                    self.book.room(split.partial.id) + split.part_tokens >= session.need):
                await self._move_rest(session, k, split)  # the move: the room it needs is the rest's share
            # else: no room for it yet, try at the next step

    async def _move_rest(self, session: Any, k: int, split: Split) -> None:
        """Rejoin by moving the whole replica's part of the cache into the session on the now-whole live replica
        (same id, verified there before anything changes); a refused move leaves the session split."""
        whole, partial, start = session.replicas[k], split.partial, self.clock()
        try:
            moved = await move_kv(self._client(), session.id, session.fed, session.need, Hop(whole.url, split.rest),
                                  Hop(partial.url), aiohttp.ClientTimeout(total=self.config.step_timeout_s))
        except (StepError, aiohttp.ClientError, OSError, TimeoutError) as exc:  # nothing changed (verified first)
            split.given_up = True
            log.warning("session %s: moving its KV cache onto %s failed (%s); staying split", session.id, partial.id,
                        exc)
            return
        self.book.release(partial.id, split.part_tokens)
        self.book.reserve(partial.id, session.need)
        del session.splits[k]
        session.replicas[k] = partial
        # the whole replica's share is free once its DELETE is answered (a new session there before would be a 429)
        self._forget(whole, session.id, then=functools.partial(self.book.release, whole.id, split.rest_tokens))
        session.rejoins += 1
        self.rejoins += 1
        self.moved.append((moved, self.clock() - start))
        log.info("session %s: rejoined stage %s on %s (%d KV bytes moved)", session.id, session.stages[k],
                 partial.id, moved)

    def _shadow_of(self, session: Any, k: int) -> Any:
        """The session as it will be after the rejoin of stage ``k``: a new id, the now-whole replica there."""
        replicas = list(session.replicas)
        replicas[k] = session.splits[k].partial
        return replace(session, id=uuid.uuid4().hex, replicas=replicas,
                       splits={j: replace(s, shadow=None, task=None) for j, s in session.splits.items() if j != k},
                       chains=dict(session.chains),
                       generated=[], fed=0)

    @staticmethod
    def _extra(session: Any, k: int, shadow: Any) -> list[tuple[Any, int]]:
        """What the background replay of stage ``k``'s rejoin books beyond the session's own bookings, replica by
        replica: the replay's whole bookings (its new id is held beside the session's own parts until the switch),
        less the room the split already holds for it on the live replica."""
        split, out = session.splits[k], []
        for r, n in bookings(shadow):
            if r is split.partial:
                n -= split.reserve
            if n > 0:
                out.append((r, n))
        return out

    def _start_shadow(self, session: Any, k: int, split: Split) -> None:
        n = session.fed
        sequence = session.prompt + session.generated
        shadow = self._shadow_of(session, k)
        split.extra = self._extra(session, k, shadow)
        for r, n in split.extra:
            self.book.reserve(r.id, n)
        split.shadow, split.base = shadow, session.id
        self.shadows += 1

        async def run() -> bool:
            start = self.clock()
            token = await self._step(shadow, sequence[:n], 0, False)
            self.replayed.append((n, self.clock() - start))
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
