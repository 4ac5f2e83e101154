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
import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from gateway_plugin import layers
from gateway_plugin.generation.kvmove import Copied, Hop, StepError, copy_kv, move_kv, trim_kv
from gateway_plugin.generation.session import Session, SessionHost, Split
from quart_kernel.picking import pick
from quart_kernel.scheduling.live_split import (
    REJOIN_MODES,
    RecutView,
    loading_left_s,
    outlives_loading,
    recut_pays,
    split_booking,
)
from quart_stage.spans import kv_charge

log = logging.getLogger("quart.generation")

__all__ = ["REJOIN_MODES", "LiveSplits", "split_for"]


def split_for(ready: list[Any], room: Callable[[str], int], need: int, rejoin: str,
              outlives: Callable[[Any], bool]) -> Split | None:
    """The split a new session takes at a stage: on a live replica that holds the stage's first layers (not yet
    all) and has room for its booking (``room(replica_id)``; the rejoin's room too when ``outlives(replica)``);
    the one holding most, then the provider's pick rule. None when there is none."""
    fits = []
    for r in ready:
        stage, held = layers.stage_range(r), r.held
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
class PreCopy:
    """A re-cut under way: the cache of the layers up to ``to`` being copied to the live replica since ``began``."""

    to: int
    began: float
    task: asyncio.Task[Copied]


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


class LiveSplits:
    """The sessions split with live replicas, for a :class:`~gateway_plugin.generation.session.SessionHost` (the
    session engine): how each live replica's layers arrive, the decode step time, and every rejoin so far."""

    def __init__(self, host: SessionHost) -> None:
        self.host = host
        self.arrivals: dict[str, LayerArrivals] = {}  # live replica id -> how its layers arrive
        self.step_s: float | None = None  # the decode steps' moving average, seconds
        self.moved: list[tuple[int, float]] = []  # each migrate rejoin: (KV bytes moved, seconds the stream waited)
        self.replayed: list[tuple[int, float]] = []  # each shadow rejoin's replay: (positions, seconds it ran beside)
        self.recuts: list[tuple[int, float, float]] = []  # each re-cut: (KV bytes, seconds the stream waited, pre-copy s)
        self.rejoins = 0  # split sessions moved onto their live replica once it was whole
        self.shadows = 0  # background replays started for a rejoin

    def split_for(self, fn: str, need: int, steps: int) -> Split | None:
        """At a session's entry (``steps`` steps to run): the split of stage ``fn`` with a live replica serving its
        first layers, if any."""
        return split_for(self.host.source.ready(fn), self.host.book.room, need, self.host.config.rejoin,
                         lambda r: self._outlives(r, steps))

    def _outlives(self, replica: Any, steps: int) -> bool:
        """Whether a session of ``steps`` steps opened now will still run when ``replica`` is whole."""
        stage, held = layers.stage_range(replica), layers.held_range(replica)
        now = self.host.clock()
        seen = self.arrivals.setdefault(replica.id, LayerArrivals(now, held[1], now, held[1]))
        seen.see(now, held[1])
        left = loading_left_s(held[1] - stage[0], stage[1] - stage[0], seen.rate())
        return outlives_loading(steps, self.step_s, left)

    def note_step(self, seconds: float, decode: bool) -> None:
        """A step's duration; a decode step's goes into the moving average the outlive prediction uses."""
        if decode:
            self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    # ------------------------------------------------------------------ rejoin

    async def rejoin(self, session: Session) -> None:
        """Before a step: move each split whose partial replica is now whole onto it, as ``QUART_GEN_REJOIN`` says;
        re-cut one whose partial replica gained layers while sessions wait for room (`_recut`)."""
        book, mode = self.host.book, self.host.config.rejoin
        for k, split in list(session.splits.items()):
            if split.task is not None and split.task.done():
                self._switch(session, k, split)
                continue
            if split.recut is not None or (not layers.is_whole(split.partial) and not split.recut_off
                                           and split.task is None and self.host.config.recut):
                await self._recut(session, k, split)  # a pre-copy under way is finished before any rejoin
                continue
            if not layers.is_whole(split.partial) or split.given_up or split.task is not None:
                continue
            if split.partial.state != "ready" or mode == "keep":
                continue
            if session.fed == 0 or mode == "replay":  # nothing held yet, or move by replay now
                if book.room(split.partial.id) + split.part_tokens >= session.need:
                    self.unsplit(session, k, onto_partial=True)
                continue
            shadow_fits = mode in ("shadow", "auto") and all(
                book.room(r.id) >= n for r, n in self._extra(session, k, self._shadow_of(session, k)))
            if shadow_fits:  # the background replay: the stream never waits
                self._start_shadow(session, k, split)
            elif mode in ("migrate", "auto") and book.room(split.partial.id) + split.part_tokens >= session.need:
                await self._move_rest(session, k, split)  # the move: the room it needs is the rest's share
            # else: no room for it yet, try at the next step

    async def _move_rest(self, session: Session, k: int, split: Split) -> None:
        """Rejoin by moving the whole replica's part of the cache into the session on the now-whole live replica
        (same id, verified there before anything changes); a refused move leaves the session split."""
        host, book = self.host, self.host.book
        whole, partial, start = session.replicas[k], split.partial, host.clock()
        try:
            moved = await move_kv(host.client(), session.id, session.fed, session.need, Hop(whole.url, split.rest),
                                  Hop(partial.url), aiohttp.ClientTimeout(total=host.config.step_timeout_s))
        except (StepError, aiohttp.ClientError, OSError, TimeoutError) as exc:  # nothing changed (verified first)
            split.given_up = True
            log.warning("session %s: moving its KV cache onto %s failed (%s); staying split", session.id, partial.id,
                        exc)
            return
        book.release(partial.id, split.part_tokens)
        book.reserve(partial.id, session.need)
        del session.splits[k]
        session.replicas[k] = partial
        # the whole replica's share is free once its DELETE is answered (a new session there before would be a 429)
        host.forget(whole, session.id, then=functools.partial(book.release, whole.id, split.rest_tokens))
        session.rejoins += 1
        self.rejoins += 1
        self.moved.append((moved, host.clock() - start))
        log.info("session %s: rejoined stage %s on %s (%d KV bytes moved)", session.id, session.stages[k],
                 partial.id, moved)

    def _recut_view(self, session: Session, k: int, split: Split, cut: int) -> RecutView:
        """What `recut_pays` weighs for moving split ``k``'s cut to ``cut`` (the live replica's held layers)."""
        book, need, span = self.host.book, session.need, (split.part[0], split.rest[1])
        gain = kv_charge(need, (split.part[0], cut), span) - kv_charge(need, split.part, span)
        room, fn = self.host.room, session.stages[k]
        waiting, head_need = room.waiting(fn), room.head_positions(fn) or need  # the head's split there now
        head = split_booking(head_need, (split.part[0], cut), span, self.host.config.rejoin, True) if waiting else None
        return RecutView(gain, (cut - split.part[1]) / max(1, span[1] - span[0]),
                         session.max_tokens - len(session.generated), book.room(split.partial.id),
                         book.room(session.replicas[k].id), head.live if head else 0, head.rest if head else 0,
                         waiting)

    async def _recut(self, session: Session, k: int, split: Split) -> None:
        """Move the cut of split ``k`` up to the layers its live replica holds now, when `recut_pays`. First the
        cache of the layers between is pre-copied from the whole replica to the live one in the background, beside
        the part (``X-Quart-KV-Staged``), while the session goes on stepping; then, before a later step, the
        positions since are copied (the stream waits for that only) and widen the part; the whole replica drops
        the layers (``DELETE .../kv?layers=``) and its share of them frees for the entry's line. The live share is
        booked from the pre-copy on. A refused copy leaves the cut where it was (and the staged layers charged
        until the session ends); a refused drop makes its next step there fail, and the session replays."""
        if split.recut is not None:
            if split.recut.task.done():
                await self._finish_recut(session, k, split)
            return
        held = layers.held_range(split.partial)
        if held is None or session.fed == 0 or held[1] <= split.part[1] or held[1] >= split.rest[1]:
            return
        view = self._recut_view(session, k, split, held[1])
        if not recut_pays(view):
            return
        host, whole = self.host, session.replicas[k]
        host.book.reserve(split.partial.id, view.gain)
        split.part_tokens += view.gain
        task = asyncio.get_running_loop().create_task(copy_kv(
            host.client(), session.id, session.need, Hop(whole.url, (split.part[1], held[1])),
            Hop(split.partial.url, (split.part[0], held[1])), self._timeout(), staged=True))
        split.recut = PreCopy(held[1], host.clock(), task)

    async def _finish_recut(self, session: Session, k: int, split: Split) -> None:
        """The pre-copy is done: copy the positions since, widen the part, drop the layers on the whole replica."""
        host, pre, whole, start = self.host, split.recut, session.replicas[k], self.host.clock()
        split.recut = None
        cut, stage = split.part[1], (split.part[0], split.rest[1])
        try:
            try:
                first = pre.task.result()
            except (Exception, asyncio.CancelledError) as exc:  # the pre-copy's own failure (not this task's cancel)
                raise StepError(f"the pre-copy failed: {exc!r}") from None
            last = await copy_kv(host.client(), session.id, session.need, Hop(whole.url, (cut, pre.to)),
                                 Hop(split.partial.url, (stage[0], pre.to)), self._timeout(), start=first.tokens)
        except (StepError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            split.recut_off = True
            log.warning("session %s: re-cutting onto %s failed (%s); staying cut at %d", session.id,
                        split.partial.id, exc, cut)
            return
        split.part, split.rest = (stage[0], pre.to), (pre.to, stage[1])
        try:
            await trim_kv(host.client(), whole.url, session.id, (cut, pre.to), self._timeout())
        except (StepError, aiohttp.ClientError, OSError, TimeoutError) as exc:  # its next step there fails: replay
            log.warning("session %s: %s did not drop layers %d-%d after a re-cut (%s)", session.id, whole.id,
                        cut, pre.to, exc)
            return  # (the rest's booking stays as the replica holds it, until the replay frees both)
        rest_tokens = kv_charge(session.need, (pre.to, stage[1]), stage)
        host.book.release(whole.id, split.rest_tokens - rest_tokens)
        split.rest_tokens = rest_tokens
        self.recuts.append((first.size + last.size, host.clock() - start, start - pre.began))

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.host.config.step_timeout_s)

    @staticmethod
    def _shadow_of(session: Session, k: int) -> Session:
        """The session as it will be after the rejoin of stage ``k``: a new id, the now-whole replica there."""
        replicas = list(session.replicas)
        replicas[k] = session.splits[k].partial
        return replace(session, id=uuid.uuid4().hex, replicas=replicas,
                       splits={j: replace(s, shadow=None, task=None) for j, s in session.splits.items() if j != k},
                       chains=dict(session.chains),
                       generated=[], fed=0)

    @staticmethod
    def _extra(session: Session, k: int, shadow: Session) -> list[tuple[Any, int]]:
        """What the background replay of stage ``k``'s rejoin books beyond the session's own bookings, replica by
        replica: the replay's whole bookings (its new id is held beside the session's own parts until the switch),
        less the room the split already holds for it on the live replica."""
        split, out = session.splits[k], []
        for r, n in shadow.bookings():
            if r is split.partial:
                n -= split.reserve
            if n > 0:
                out.append((r, n))
        return out

    def _start_shadow(self, session: Session, k: int, split: Split) -> None:
        n = session.fed
        sequence = session.prompt + session.generated
        shadow = self._shadow_of(session, k)
        split.extra = self._extra(session, k, shadow)
        self.host.book.reserve_all(split.extra)
        split.shadow, split.base = shadow, session.id
        self.shadows += 1

        async def run() -> bool:
            start = self.host.clock()
            token = await self.host.step(shadow, sequence[:n], 0, False)
            self.replayed.append((n, self.host.clock() - start))
            if token != sequence[n]:
                log.warning("session %s: the rejoin replay answered token %d, the session has %d: staying split",
                            session.id, token, sequence[n])
                return False
            shadow.fed = n
            return True

        split.task = asyncio.get_running_loop().create_task(run())

    def _switch(self, session: Session, k: int, split: Split) -> None:
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
        book, shadow = self.host.book, split.shadow
        split.task = split.shadow = None
        self.host.drop(session)  # the old id on every replica, the split's two parts included
        book.release_all(split.extra)  # the replay's extra bookings become the session's: book what it holds now
        book.release_all(session.bookings())
        book.reserve_all(shadow.bookings())
        session.replicas, session.splits = shadow.replicas, shadow.splits
        self.host.renew(session, shadow.id)
        session.fed = shadow.fed
        session.rejoins += 1
        self.rejoins += 1
        log.info("session %s: rejoined stage %s on %s (background replay of %d positions)", session.id,
                 session.stages[k], split.partial.id, shadow.fed)

    def unsplit(self, session: Session, k: int, onto_partial: bool) -> None:
        """End the split of stage ``k`` now: the stage runs whole on the partial replica (``onto_partial``, it is
        whole) or on the session's whole replica; the session replays from Pos 0 under a new id."""
        split = session.splits.get(k)
        if split is None:
            return
        book = self.host.book
        self._discard_shadow(split)
        self.host.drop(session)
        book.release_all(session.bookings())
        del session.splits[k]
        if onto_partial:
            session.replicas[k] = split.partial
            session.rejoins += 1
            self.rejoins += 1
        book.reserve_all(session.bookings())
        self.host.renew(session)
        session.fed = 0

    def _discard_shadow(self, split: Split) -> None:
        """Stop a background replay and free what it holds (its id on every replica, its bookings), and a re-cut's
        pre-copy (its booking is the split's own)."""
        if split.recut is not None:
            split.recut.task.cancel()
            split.recut = None
        shadow, task = split.shadow, split.task
        split.shadow = split.task = None
        if task is not None and not task.done():
            task.cancel()
        if shadow is not None:
            self.host.drop(shadow)
            self.host.book.release_all(split.extra)
        split.extra = []

    def end(self, session: Session) -> None:
        """The session ended: stop its background replays (its own ids are freed by the engine)."""
        for split in session.splits.values():
            self._discard_shadow(split)
