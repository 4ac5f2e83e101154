"""The session engine: one generation request = one session through the pipeline's stages.

- **Affinity**: at its start a session is placed on one replica per stage (:class:`.kvbook.KVBook`: a replica
  with room for every position it may hold; none → it waits in line, :mod:`.roomwait`, bounded, then 429); every
  step goes to those replicas, which keep its KV cache for their own layers (docs/generation.md).
- **Steps**: the first step carries the whole prompt (prefill, ``X-Quart-Session-Pos: 0``), every later one the
  last sampled token only, at the position the caches hold; the last stage answers the next token. Steps of
  different sessions overlap across the stages (B's at stage 0 while A's at stage 2; batched by micro-batch
  groups, :mod:`.decodebatch`); a replica's steps beyond its concurrency wait (:class:`.slots.StepSlots`).
- **Failover by replay**: a replica that fails a step (no answer, 5xx, 429, or 409: it does not hold the
  session) is replaced by another ready replica of its stage, the session gets a new id, and the next
  step feeds every token so far (prompt + generated) from position 0 through all stages; the others
  keep their replicas and drop the old session's cache. Sampling is a pure function of (seed, position,
  logits), so the tokens are the same as without the failure. After ``max_replays`` the stream ends
  with an error.
- **Moving off a leaving replica**: before each step, a session pinned to a replica that is draining
  (scale-down, rolling update) moves by the same replay to another ready replica of that stage with room
  (not counted against ``max_replays``); one that finds no room stays, and the replica's drain waits for
  it (bounded by the gateway's drain timeout; if it stops first, the next step fails over as above).
- **ParaServe groups** (:mod:`.groupsessions`): while a stage has only a group's parts, a session runs on a chain
  of them; once a replica is whole, its KV caches move there (verified) and it goes on with no re-prefill.
- **Live scale-ups** (:mod:`.cooperative`): a session opened while a new replica of a stage holds only its
  first layers is split there (that replica runs those layers, a whole one the rest, each keeping the KV
  cache of its layers) and rejoins the new replica once it is whole.
- **Freeing**: the step that yields the last allowed token carries ``X-Quart-Session-End``; a session
  that ends otherwise (EOS, a stop string, the client gone, an error) is deleted on every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from gateway_plugin import layers, ports
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.cooperative import LiveSplits
from gateway_plugin.generation.decodebatch import (
    DecodeJob,
    ReplicaLane,
    Row,
    batch_answers,
    batch_request,
    token_row,
)
from gateway_plugin.generation.groupsessions import GroupChains, unchained
from gateway_plugin.generation.kvbook import KV_HEADER, KVBook
from gateway_plugin.generation.kvmove import delete_session
from gateway_plugin.generation.roomwait import RoomQueue
from gateway_plugin.generation.session import Chain, Session, Split, StepFailed, stage_bookings
from gateway_plugin.generation.slots import StepSlots
from gateway_plugin.metrics import BatchTimes, MetricsCollector
from quart_stage.batchwire import BatchEntry
from quart_stage.errors import QuartError, unavailable
from quart_transport.dead_peer import dead_peer_connector
from quart_transport.retry import replica_gone

log = logging.getLogger("quart.generation")

SESSION, SESSION_POS, SESSION_END = "X-Quart-Session", "X-Quart-Session-Pos", "X-Quart-Session-End"
SESSION_RESERVE = "X-Quart-Session-Reserve"  # at Pos 0: the replica books prompt + max_tokens up front
SAMPLE = "X-Quart-Sample"


class SessionEngine:
    """Places sessions, runs their steps, replays them after a failure; holds the live splits and the group chains
    (it is their :class:`~gateway_plugin.generation.session.SessionHost`)."""

    def __init__(self, source: ports.ReplicaSource, config: GenerationConfig, clock: Callable[[], float] = time.monotonic,
                 on_call: Callable[[str, int, float], None] | None = None, poll_s: float = 0.05,
                 decode_limit: Callable[[str], int] | None = None, collector: MetricsCollector | None = None) -> None:
        self.source = source
        self.collector = collector  # each step at a stage: an arrival, its wait and its service, as the router's calls
        self.config = config
        self.clock = clock
        self.on_call = on_call
        self.poll_s = poll_s
        self.decode_limit = decode_limit  # a stage function's decode batch limit (its label), else the setting
        self._lanes: dict[str, ReplicaLane] = {}  # replica id -> its batched session calls (decode batching on)
        self.room = RoomQueue(config.room_queue, config.retry_after_s, poll_s, clock)  # new sessions waiting for KV room
        self.book = KVBook(config.kv_tokens, on_release=self.room.freed)
        self.http: aiohttp.ClientSession | None = None
        self._slots: dict[str, StepSlots] = {}
        self._background: set[asyncio.Task] = set()
        self.active: dict[str, Session] = {}
        self.moves, self._opened = 0, itertools.count()  # sessions moved off draining replicas; sessions opened
        self._generating: set[str] = set()  # stage functions that have held a session (decoder stages)
        self.decode_steps: dict[str, BatchTimes] = {}  # stage function -> its decode steps' time by batch size
        self.live_splits = LiveSplits(self)  # sessions split with a live replica during its loading
        self.group_chains = GroupChains(self)  # sessions on a ParaServe group's parts, and their consolidation

    async def close(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, 2.0)
        if self.http is not None:
            await self.http.close()
            self.http = None

    def client(self) -> aiohttp.ClientSession:
        if self.http is None:
            self.http = aiohttp.ClientSession(connector=dead_peer_connector(limit=0, enable_cleanup_closed=True),
                                              timeout=aiohttp.ClientTimeout(total=None))
        return self.http

    # ------------------------------------------------------------------ placement

    def _ready(self, function: str) -> list[ports.Replica]:
        return [r for r in self.source.ready(function) if layers.is_whole(r)]

    async def _choose(self, function: str, need: int, excluded: set[str], steps: int | None = None,
                      wait_s: float | None = None, gone: Callable[[], bool] | None = None, first: bool = False
                      ) -> tuple[Any, Split | None]:
        """Where stage ``function`` of a session of ``need`` positions runs: a replica with room (with ``steps`` to
        run, a new session may be split with a live replica), or while the stage has no whole replica a `Chain` of
        a ParaServe group's parts. Waits (bounded, counted) while it has neither; while its ready replicas have no
        room, waits in line for it (:mod:`.roomwait`, up to ``wait_s``, default ``QUART_GEN_ROOM_WAIT_S``), then 429."""
        deadline = self.clock() + self.config.replica_wait_s
        while True:
            if any(r.id not in excluded for r in self._ready(function)):
                fit = functools.partial(self._fit, function, need, excluded, steps)
                return await self.room.placed(function, fit, f"{need} more KV-cache positions",
                                              self.config.room_wait_s if wait_s is None else wait_s, gone, first,
                                              need)
            chain = self.group_chains.chain_for(function, need, excluded)
            if chain is not None:
                return chain, None
            if self.clock() >= deadline:
                raise unavailable(503, f"stage {function!r} has no ready replica", self.config.retry_after_s)
            with self.group_chains.waiting_for(function):
                await asyncio.sleep(self.poll_s)

    def _fit(self, function: str, need: int, excluded: set[str], steps: int | None) -> tuple[Any, Split | None] | None:
        """A ready whole replica of ``function`` with room now (for a new session's share if split); else None."""
        split = self.live_splits.split_for(function, need, steps) if steps and self.config.cooperative else None
        ready = [r for r in self._ready(function) if r.id not in excluded]
        replica = self.book.choose(ready, split.rest_tokens if split else need)
        return None if replica is None else (replica, split)

    async def open(self, model: str, stages: list[str], prompt: list[int], max_tokens: int,
                   sample: dict[str, Any], eos: frozenset[int], wait_s: float | None = None,
                   gone: Callable[[], bool] | None = None) -> Session:
        """Place a new session (one replica per stage, its positions booked on each) or raise 429 / 503 (499 when
        ``gone()`` while it waits for room). ``wait_s``: the most it may wait for room (the client's deadline)."""
        need = len(prompt) + max_tokens
        chosen: list[Any] = []
        splits: dict[int, Split] = {}
        self.group_chains.noted(stages, need)
        until = self.clock() + min(self.config.room_wait_s, self.config.room_wait_s if wait_s is None else wait_s)
        try:
            for k, fn in enumerate(stages):  # the wait for room, over all stages, ends at ``until``
                left = max(0.0, until - self.clock())
                replica, split = await self._choose(fn, need, set(), steps=max_tokens, wait_s=left, gone=gone)
                chosen.append(replica)
                if split is not None:
                    splits[k] = split
                self.book.reserve_all(stage_bookings(replica, need, split))
        except BaseException:
            for k, replica in enumerate(chosen):
                self.book.release_all(stage_bookings(replica, need, splits.get(k)))
            raise
        if sample.get("seed") is None:
            sample = {**sample, "seed": random.getrandbits(63)}  # fixed for the session: a replay samples the same
        else:
            sample = {**sample, "seed": sample["seed"] % 2**63}  # the stage's range; OpenAI's seed may be negative
        replicas, chains = unchained(chosen)
        session = Session(model, list(stages), replicas, need, list(prompt), max_tokens, sample, eos, splits=splits,
                          chains=chains, micro=next(self._opened) % len(stages))  # dealt round robin
        self.active[session.id] = session
        self._generating.update(stages)
        return session

    # ------------------------------------------------------------------ running

    async def tokens(self, session: Session) -> AsyncIterator[int]:
        """The session's tokens as they come; ends at max_tokens or EOS (``finish_reason`` says which). The
        caller may stop early (a stop string, the client gone): closing the iterator frees the caches."""
        try:
            while len(session.generated) < session.max_tokens:
                token = await self._advance(session)
                session.add(token)
                if token in session.eos:
                    session.finish_reason = "stop"
                    yield token
                    return
                yield token
            session.finish_reason = "length"
        finally:
            self.finish(session)

    async def _advance(self, session: Session) -> int:
        """One step (or, after a failure, the replay that rebuilds the caches) and its token."""
        while True:
            await self.live_splits.rejoin(session)
            await self.group_chains.consolidate(session)
            self._move_off_leaving(session)
            sequence = session.prompt + session.generated
            last = len(session.generated) + 1 == session.max_tokens
            start = self.clock()
            try:
                token = await self.step(session, sequence[session.fed:], session.fed, last)
            except StepFailed as failed:
                await self._replace(session, failed)
                continue
            self.live_splits.note_step(self.clock() - start, decode=len(sequence) - session.fed == 1)
            session.fed = len(sequence)
            session.freed = last
            return token

    async def _replace(self, session: Session, failed: StepFailed) -> None:
        session.replays += 1
        fn = session.stages[failed.stage]
        log.info("session %s: stage %s replica %s failed (%s); replay %d", session.id, fn, failed.replica.id,
                 failed.why, session.replays)
        if session.replays > self.config.max_replays:
            raise QuartError(502, f"stage {fn!r} failed {session.replays} time(s) for this generation; last: "
                                  f"{failed.why}", "stage")
        split = session.splits.get(failed.stage)
        if split is not None:  # the stage runs whole on the whole replica again (the live part is given up)
            self.live_splits.unsplit(session, failed.stage, onto_partial=False)
            if split.partial is failed.replica:
                return
        self.drop(session)  # the old session id on every replica
        if failed.stage in session.chains:
            self.group_chains.unchain(session, failed.stage, free=False)
        else:
            self.book.release(failed.replica.id, session.need)
        session.replicas[failed.stage] = None
        excluded = set() if failed.keep else {failed.replica.id}
        if failed.why.startswith("HTTP 429"):  # a full cache (a DELETE on its way frees it): not at once
            await asyncio.sleep(self.poll_s)
        try:
            replacement, _ = await self._choose(fn, session.need, excluded, first=True)
        except QuartError as exc:
            raise QuartError(exc.status, f"a replica of stage {fn!r} failed ({failed.why}) and no other could take "
                                         f"the session over: {exc.message}", "stage", exc.headers) from None
        self.rehome(session, failed.stage, replacement)

    def _move_off_leaving(self, session: Session) -> None:
        """Move the session by replay off every replica of it that is draining, where another ready replica
        of that stage has room (else it stays: the drain waits for it, bounded)."""
        for k, replica in enumerate(session.replicas):
            if replica is None or replica.state != "draining":  # None: a chain runs the stage
                continue
            self.live_splits.unsplit(session, k, onto_partial=False)
            target = self.book.choose(self._ready(session.stages[k]), session.need, excluded={replica.id})
            if target is None:
                continue
            log.info("session %s: stage %s replica %s is draining; moving to %s by replay", session.id,
                     session.stages[k], replica.id, target.id)
            self.drop(session)
            self.book.release(replica.id, session.need)
            self.rehome(session, k, target)
            session.moves += 1
            self.moves += 1

    def rehome(self, session: Session, stage: int, placed: ports.Replica | Chain) -> None:
        """Pin ``stage`` of the session to ``placed`` (a replica booked ``need``, or a `Chain` its shares) under a
        new id; the next step replays from 0."""
        session.replicas[stage] = None if isinstance(placed, Chain) else placed
        if isinstance(placed, Chain):
            session.chains[stage] = placed
        self.book.reserve_all(stage_bookings(placed, session.need, None))
        self.renew(session)
        session.fed = 0

    def renew(self, session: Session, new_id: str | None = None) -> None:
        """The session goes on under a new id (a fresh one, or ``new_id``)."""
        self.active.pop(session.id, None)
        session.id = new_id or uuid.uuid4().hex
        self.active[session.id] = session

    async def step(self, session: Session, new: list[int], pos: int, last: bool) -> int:
        """One step: a decode step in its replicas' batches (decode batching on), else one call per stage; a
        long prompt in chunks of ``prefill_chunk`` positions where decode steps batch (the bound on their stall)."""
        limit = min(self._decode_max(fn) for fn in session.stages)
        if limit > 1 and pos > 0 and len(new) == 1 and not session.splits and not session.chains:  # steps alone
            return await self._batched_step(session, new[0], pos, last, limit)
        size = self.config.prefill_chunk if limit > 1 and self.config.prefill_chunk else len(new)
        token = 0
        for at in range(0, len(new), size):
            part = new[at : at + size]
            token = await self._single_step(session, part, pos + at, last and at + len(part) == len(new), limit)
        return token

    def _decode_max(self, function: str) -> int:
        return self.decode_limit(function) if self.decode_limit is not None else self.config.decode_batch_max

    def _lane(self, session: Session, k: int, limit: int) -> ReplicaLane:
        """The lane of the session's replica at stage ``k`` (made on first use; the limit as the labels say now,
        the hold as the settings say)."""
        fn, replica = session.stages[k], session.replicas[k]
        lane = self._lanes.get(replica.id)
        if lane is None:
            send = functools.partial(self._send_batch, k, fn, replica, session.model, k == len(session.stages) - 1)
            lane = self._lanes[replica.id] = ReplicaLane(self.source.concurrency(fn), limit, send)
        lane.max_batch, lane.hold_s = limit, self.config.decode_hold_ms / 1000
        return lane

    async def _batched_step(self, session: Session, token: int, pos: int, last: bool, limit: int) -> int:
        row, final, result = token_row(token), len(session.stages) - 1, {}
        for k, (fn, replica) in enumerate(zip(session.stages, session.replicas, strict=True)):
            entry = BatchEntry(session.id, pos, last, session.step_sample() if k == final else {})
            self._arrived(fn)
            result, row = await self._lane(session, k, limit).decode(entry, row, session.micro)
            status = int(result.get("status", 0))
            if status == 409:
                raise StepFailed(k, replica, "409: it does not hold the session", keep=True)
            if status == 429 or status >= 500:
                raise StepFailed(k, replica, f"HTTP {status}: {str(result.get('error'))[:200]}", keep=status == 429)
            if status != 200:
                raise QuartError(status, str(result.get("error") or f"stage {fn!r} answered {status}"), "stage")
        try:
            return session.took(result)
        except (KeyError, TypeError, ValueError):
            raise StepFailed(final, session.replicas[final], "the last stage answered no token") from None

    async def _send_batch(self, k: int, fn: str, replica: Any, model: str, last: bool,
                          jobs: list[DecodeJob]) -> list[tuple[dict, Row | None]]:
        """One batched decode step on ``replica``; a failed call fails every session of it over (StepFailed)."""
        body, headers = batch_request(k, model, jobs)
        now, loop_now = self.clock(), asyncio.get_running_loop().time()
        arrived = tuple(now - (loop_now - job.since) for job in jobs)  # each step's arrival, on the engine's clock
        status, data, answer = await self._post(k, fn, replica, body, headers, arrived=arrived, decode=True)
        self.book.note(replica.id, answer.get(KV_HEADER))
        if status == 200:
            try:
                return batch_answers(jobs, data, last)
            except (ValueError, KeyError, TypeError) as exc:
                raise StepFailed(k, replica, f"a batched step's answer does not fit the batch: {exc}") from None
        if status == 429 or status >= 500:
            raise StepFailed(k, replica, f"HTTP {status}: {data[:200].decode(errors='replace')}")
        raise QuartError(status, _error_text(data) or f"stage {fn!r} answered {status} to a batched step", "stage")

    async def _single_step(self, session: Session, new: list[int], pos: int, last: bool, limit: int) -> int:
        body, ctype = json.dumps({"input_ids": [new]}).encode(), "application/json"
        final = len(session.stages) - 1
        for k, fn in enumerate(session.stages):
            for replica, part in session.calls(k):  # the whole stage, or a split's two parts in order
                headers = {"Content-Type": ctype, SESSION: session.id, SESSION_POS: str(pos),
                           "X-Quart-Model": session.model, "X-Quart-Stage": str(k)}
                if part is not None:
                    headers[layers.LAYERS] = layers.format_range(part)
                if k == final:  # every part of the last stage: either may come to run it whole (a rejoin)
                    headers[SAMPLE] = json.dumps(session.step_sample())
                    if part is None or k in session.chains or part[1] == layers.stage_range(replica)[1]:
                        headers["Accept"] = "application/json"
                if pos == 0:
                    headers[SESSION_RESERVE] = str(session.need)
                if last:
                    headers[SESSION_END] = "1"
                arrived = (self._arrived(fn),) if part is None else ()  # a split's parts are not the stage's steps
                step = {"arrived": arrived, "decode": pos > 0 and len(new) == 1}
                if limit > 1 and replica is session.replicas[k]:  # a split's rest too: between the lane's batches
                    status, data, answer = await self._lane(session, k, limit).solo(
                        functools.partial(self._post, k, fn, replica, body, headers, **step))
                else:
                    call = functools.partial(self._call, k, fn, replica, body, headers, running=pos > 0, **step)
                    status, data, answer = await (self.group_chains.part_call(call) if k in session.chains else call())
                self.book.note(replica.id, answer.get(KV_HEADER))
                held = layers.parse_range(answer.get(layers.HELD))
                if held is not None and held != replica.held:
                    self.source.note_held(fn, replica, held)  # a live replica's layers grow; whole, it joins ready
                if status == 409:
                    raise StepFailed(k, replica, "409: it does not hold the session", keep=True)
                if status == 429 or status >= 500:  # a full cache: the replica may take the replay once room frees
                    raise StepFailed(k, replica, f"HTTP {status}: {data[:200].decode(errors='replace')}",
                                     keep=status == 429)
                if status != 200:
                    raise QuartError(status, _error_text(data) or f"stage {fn!r} answered {status}", "stage")
                body, ctype = data, answer.get("Content-Type", "application/octet-stream")
        try:
            return session.took(json.loads(body))
        except (ValueError, KeyError, TypeError):
            raise StepFailed(final, session.replicas[final], "the last stage answered no token") from None

    async def _call(self, k: int, fn: str, replica: Any, body: bytes, headers: dict[str, str], running: bool,
                    arrived: tuple[float, ...] = (), decode: bool = False) -> tuple[int, bytes, dict[str, str]]:
        gate = self._slots.get(replica.id)
        if gate is None:
            gate = self._slots[replica.id] = StepSlots(max(0, self.source.concurrency(fn)))
        async with gate.hold(running):
            return await self._post(k, fn, replica, body, headers, arrived=arrived, decode=decode)

    def _arrived(self, fn: str) -> float:
        """A step reaches stage ``fn`` now (the collector's arrival, as the router counts a request's)."""
        now = self.clock()
        if self.collector is not None:
            self.collector.stage(fn).on_arrival(now, 0.0)
        return now

    def _served(self, fn: str, arrived: tuple[float, ...], start: float, end: float, decode: bool) -> None:
        """A call of ``len(arrived)`` steps answered: each step's wait and its share of the call (the simulator's
        rule), and a decode call's time in the stage's table by batch size."""
        if decode:
            self.decode_steps.setdefault(fn, BatchTimes()).record(len(arrived), end - start)
        if self.collector is not None:
            stats = self.collector.stage(fn)
            for at in arrived:
                stats.on_dispatch(start, max(0.0, start - at))
                stats.on_complete(end, (end - start) / len(arrived))

    async def _post(self, k: int, fn: str, replica: Any, body: bytes, headers: dict[str, str],
                    arrived: tuple[float, ...] = (), decode: bool = False) -> tuple[int, bytes, dict[str, str]]:
        """One call to a stage replica (the caller holds its slot); StepFailed when it gives no answer. A call that
        carried steps (``arrived``: when each reached the stage) and succeeded is counted (``_served``)."""
        start = self.clock()
        status = 0
        self.source.take(fn, replica)
        try:
            async with self.client().post(
                replica.url, data=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.config.step_timeout_s),
            ) as resp:
                data = await resp.read()
                status = resp.status
                if arrived and status == 200:
                    self._served(fn, arrived, start, self.clock(), decode)
                return status, data, dict(resp.headers)
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
            status = 504 if isinstance(exc, TimeoutError) else 502
            if replica_gone(exc):
                self.source.mark_unreachable(fn, replica)
            raise StepFailed(k, replica, f"{type(exc).__name__}: {exc}") from None
        finally:
            self.source.give_back(fn, replica)
            if self.on_call is not None:
                with contextlib.suppress(Exception):
                    self.on_call(fn, status, self.clock() - start)

    # ------------------------------------------------------------------ what the controller sees

    def batch_sizes(self) -> dict[str, dict[str, int]]:
        """Batched decode steps sent per replica, by batch size, since the start."""
        return {rid: {str(k): v for k, v in sorted(lane.batches.items())} for rid, lane in self._lanes.items()}

    def stage_generation(self, function: str) -> tuple[int, int, int]:
        """(sessions, KV positions booked, KV capacity of its ready replicas) of one stage function, its line's
        waiting sessions and their positions included (demand); capacity: each ready replica's reported cap
        (``QUART_GEN_KV_TOKENS`` until it has), 0 for a stage that never held a session (an encoder's)."""
        mine = [s for s in self.active.values() if function in s.stages]
        sessions, booked = len(mine) + self.room.waiting(function), sum(s.need for s in mine) + self.room.waiting_positions(function)
        if function not in self._generating:
            return sessions, booked, 0
        return sessions, booked, sum(self.book.cap(r.id) for r in self._ready(function))

    def stage_decode(self, function: str) -> tuple[tuple[tuple[int, int, float], ...], int]:
        """(sessions per step, steps, mean s) of the stage's decode steps by batch size, and its decode batch limit."""
        times = self.decode_steps.get(function)
        return (times.table() if times is not None else ()), max(1, self._decode_max(function))

    # ------------------------------------------------------------------ freeing

    def finish(self, session: Session) -> None:
        """Release the session's bookings and free its caches (unless its last step already did)."""
        if self.active.pop(session.id, None) is None:
            return
        self._leave_lanes(session.id)
        self.live_splits.end(session)
        if not session.freed:
            self.drop(session)
        self.book.release_all(session.bookings())

    def drop(self, session: Session) -> None:
        """``DELETE /_/sessions/<id>`` on every replica of the session (its splits' live parts too), in the
        background."""
        self._leave_lanes(session.id)
        for replica in [*session.replicas, *session.partials()]:
            if replica is not None:
                self.forget(replica, session.id)

    def forget(self, replica: ports.Replica, session_id: str, then: Callable[[], None] | None = None) -> None:
        """``DELETE /_/sessions/<id>`` on one replica, in the background; ``then()`` once it is answered (or failed)."""
        task = asyncio.get_running_loop().create_task(delete_session(self.client(), replica.url, session_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if then is not None:
            task.add_done_callback(lambda _: then())



    def _leave_lanes(self, session_id: str) -> None:
        """No lane holds its batch for this session id any more (decodebatch.hold_for)."""
        for lane in self._lanes.values():
            lane.leave(session_id)


def _error_text(data: bytes) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(data).get("error", ""))
    return ""
