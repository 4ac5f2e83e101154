"""Continuous batching of decode steps, where the steps wait: one lane per stage replica (docs/batching.md#decode).

Every session call to a replica goes through its :class:`ReplicaLane`. Decode steps (one position each) wait
in the decode queue; prefill chunks (and any other single-session call) in the solo queue. Whenever the replica
has a free slot (its ``com.quart.concurrency``, 1 when unlimited: the stage runs a batch with all its cores)
the lane sends either **every decode step waiting** (up to the stage's decode batch limit) as one batched step,
or **one** prefill chunk; when both wait they alternate. So a session joins the batch at the first step
boundary after it arrives, leaves it when its step is answered, and a decode step waits at a replica for at
most one batch before it and one prefill chunk (``QUART_GEN_PREFILL_CHUNK`` positions) — the bound on how long a
long prompt stalls the streams already running.

**Holding for the group** (``hold_s`` > 0, :func:`hold_for`): the lane knows its *members*, the sessions whose
decode steps it has run and that have not left (their last step, a failover, the end). When the replica frees
and some members are neither waiting nor in service here, their step is on its way (at another stage, or
between tokens at the gateway): the lane holds the waiting steps until those arrive, at most ``hold_s`` after the
oldest came and never past the batch limit. So a replica's sessions move through the stages as one batch instead
of scattering into small groups over the pipelined stages. It never waits for a batch to fill otherwise: with
nothing else coming, what waits goes at once.

**Micro-batches across stages** (issue 39 item 3): a pipeline's sessions are dealt, round robin as they open, into as
many *groups* as it has stages (``Session.micro``), and a lane holds and batches each group on its own: a free
replica sends the oldest group whose members are all there (or whose hold ran out), never mixing groups. So while
stage 1 computes group 0's step, stage 0 computes group 1's: S micro-batches keep S stages busy at once, where one
batch of every session would leave all but one stage idle (GPipe's micro-batches, the decode loop of Petals' and
vLLM's pipeline-parallel schedulers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from quart_stage.batchwire import (
    H_SESSION_BATCH,
    META_RESULTS,
    META_SESSIONS,
    BatchEntry,
    pack_rows,
    split_rows,
)

OCTET = "application/octet-stream"
# decode steps waiting in a lane of this process, by session (every lane reads it: a session waiting in one lane is
# not on its way to another, so no lane holds for it — two lanes never wait for each other's sessions)
QUEUED: Counter[str] = Counter()


@dataclass(frozen=True)
class Row:
    """One session's activation row at a stage: raw bytes of ``dtype`` and shape ``[1, *shape]``; a token id
    (``dtype`` I64, shape ``[1]``) at stage 0."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]


@dataclass
class DecodeJob:
    """One session's decode step waiting for a replica."""

    entry: BatchEntry
    row: Row
    future: asyncio.Future = field(repr=False)
    since: float = 0.0  # the loop's time it arrived
    group: int = 0  # its session's micro-batch (Session.micro): batched and held with its group only


def hold_for(waiting: int, coming: int, max_batch: int, waited_s: float, hold_s: float) -> float:
    """Seconds a free lane holds its ``waiting`` decode steps for the ``coming`` members on their way (0: send now):
    never when none is coming, the batch is full, or the oldest has waited ``hold_s`` already."""
    if hold_s <= 0 or coming <= 0 or waiting >= max_batch or waited_s >= hold_s:
        return 0.0
    return hold_s - waited_s


SendBatch = Callable[[list[DecodeJob]], Awaitable[list[tuple[dict, Row | None]]]]


class ReplicaLane:
    """The session calls of one stage replica: decode steps batched, prefill chunks one at a time, alternating."""

    def __init__(self, slots: int, max_batch: int, send: SendBatch, hold_s: float = 0.0) -> None:
        self.slots, self.max_batch, self.send, self.hold_s = max(1, slots), max(1, max_batch), send, hold_s
        self.members: dict[str, int] = {}  # sessions decoding here that will come back (hold_for) -> their group
        self.serving: set[str] = set()  # sessions in a batch in service here
        self._timer: asyncio.TimerHandle | None = None
        self.decodes: deque[DecodeJob] = deque()
        self.solos: deque[tuple[Callable[[], Awaitable[Any]], asyncio.Future]] = deque()
        self.busy = 0
        self.last_solo = False
        self.batches: dict[int, int] = {}  # batch size -> batched calls sent (what /sessions reports)
        self._tasks: set[asyncio.Task] = set()

    async def decode(self, entry: BatchEntry, row: Row, group: int = 0) -> tuple[dict, Row | None]:
        """Run this decode step in the next batch of its ``group``: the session's result (``status`` …) and its
        output row."""
        loop = asyncio.get_running_loop()
        job = DecodeJob(entry, row, loop.create_future(), loop.time(), group)
        if entry.end:
            self.members.pop(entry.id, None)
        else:
            self.members[entry.id] = group
        self.decodes.append(job)
        QUEUED[entry.id] += 1
        self._pump()
        return await _wait(job.future, lambda: self._unqueue(job))

    def _unqueue(self, job: DecodeJob) -> None:
        self.decodes.remove(job)  # ValueError when it was taken already (the caller suppresses it)
        _dequeued(job.entry.id)

    def leave(self, session_id: str) -> None:
        """The session decodes here no more (it ended, failed over, moved): nothing holds for it."""
        if session_id in self.members:
            del self.members[session_id]
            self._pump()

    async def solo(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``call`` (one single-session request: a prefill chunk) when its turn comes."""
        item = (call, asyncio.get_running_loop().create_future())
        self.solos.append(item)
        self._pump()
        return await _wait(item[1], lambda: self.solos.remove(item))

    def _pump(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.busy < self.slots and (self.decodes or self.solos):
            group, hold = self._next_group() if self.decodes else (None, 0.0)
            if self.solos and (not self.decodes or not self.last_solo or hold > 0):
                call, future = self.solos.popleft()
                self.last_solo = True
                self._start(self._run_solo(call, future))
            elif hold > 0:
                self._timer = asyncio.get_running_loop().call_later(hold, self._pump)
                return
            else:
                self.last_solo = False
                self._start(self._run_batch(self._take(group)))

    def _next_group(self) -> tuple[int, float]:
        """The group to send now (the oldest waiting one whose hold is over), else the shortest hold left."""
        now, firsts = asyncio.get_running_loop().time(), {}
        for job in self.decodes:
            firsts.setdefault(job.group, job.since)
        best: tuple[int, float] | None = None
        for group, since in firsts.items():  # oldest first
            hold = self._hold(group, now - since)
            if hold <= 0:
                return group, 0.0
            if best is None or hold < best[1]:
                best = (group, hold)
        assert best is not None
        return best

    def _hold(self, group: int, waited: float) -> float:
        """How long ``group``'s waiting steps hold for its members on their way: in service at another stage or
        between tokens, not waiting in a lane (here or at another stage: two lanes must never hold for each
        other's waiting sessions)."""
        waiting = sum(1 for j in self.decodes if j.group == group)
        coming = sum(1 for sid, g in self.members.items()
                     if g == group and sid not in self.serving and not QUEUED[sid])
        return hold_for(waiting, coming, self.max_batch, waited, self.hold_s)

    def _take(self, group: int | None) -> list[DecodeJob]:
        """The waiting decode steps of ``group`` that share the row shape of its oldest, up to the limit (the
        others stay, in order)."""
        head = next(j.row for j in self.decodes if j.group == group)
        batch, keep = [], deque()
        while self.decodes:
            job = self.decodes.popleft()
            if (len(batch) < self.max_batch and job.group == group
                    and (job.row.dtype, job.row.shape) == (head.dtype, head.shape)):
                batch.append(job)
                _dequeued(job.entry.id)
            else:
                keep.append(job)
        self.decodes = keep
        return batch

    def _start(self, coro: Awaitable[None]) -> None:
        self.busy += 1
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self.busy -= 1
        self._pump()

    async def _run_solo(self, call: Callable[[], Awaitable[Any]], future: asyncio.Future) -> None:
        try:
            result = await call()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting session
            _settle(future, exc=exc)
        else:
            _settle(future, result)

    async def _run_batch(self, jobs: list[DecodeJob]) -> None:
        live = [j for j in jobs if not j.future.done()]
        if not live:
            return
        self.batches[len(live)] = self.batches.get(len(live), 0) + 1
        ids = {j.entry.id for j in live}
        self.serving |= ids
        try:
            answers = await self.send(live)
        except BaseException as exc:  # noqa: BLE001 - every session of the batch sees the failure
            for job in live:
                _settle(job.future, exc=exc)
            return
        finally:
            self.serving -= ids
        for job, answer in zip(live, answers, strict=True):
            _settle(job.future, answer)


def _dequeued(session_id: str) -> None:
    QUEUED[session_id] -= 1
    if QUEUED[session_id] <= 0:
        del QUEUED[session_id]


def _settle(future: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


async def _wait(future: asyncio.Future, unqueue: Callable[[], None]) -> Any:
    """The job's answer; a session that goes away (cancelled) while queued leaves the queue."""
    try:
        return await future
    except asyncio.CancelledError:
        with contextlib.suppress(ValueError):
            unqueue()
        raise


def batch_request(stage: int, model: str, jobs: list[DecodeJob]) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one batched step at ``stage`` (quart_stage.batchwire)."""
    head = jobs[0].row
    name = "input_ids" if stage == 0 else "hidden_states"
    meta = {"model": model, "stage": str(stage), META_SESSIONS: json.dumps([j.entry.doc() for j in jobs])}
    body = pack_rows(name, head.dtype, head.shape, [j.row.data for j in jobs], meta)
    return body, {"Content-Type": OCTET, H_SESSION_BATCH: str(len(jobs)), "X-Quart-Model": model,
                  "X-Quart-Stage": str(stage), "Accept": f"{OCTET}, application/json"}


def batch_answers(jobs: list[DecodeJob], data: bytes, last: bool) -> list[tuple[dict, Row | None]]:
    """Each job's result and output row from a 200 answer; ValueError when it does not match the batch."""
    if last:
        results, rows, dtype, shape = json.loads(data)[META_RESULTS], [], "", ()
    else:
        rows, dtype, row_shape, meta = split_rows(data, "hidden_states")
        results, shape = json.loads(meta[META_RESULTS]), tuple(row_shape)
    if not isinstance(results, list) or len(results) != len(jobs):
        raise ValueError(f"the stage answered {len(results) if isinstance(results, list) else 'no'} results "
                         f"for {len(jobs)} sessions")
    out, ok = [], iter(rows)
    for job, result in zip(jobs, results, strict=True):
        if not isinstance(result, dict) or result.get("id") != job.entry.id:
            raise ValueError("the stage's results are not in the batch's order")
        row = None
        if result.get("status") == 200 and not last:
            data_row = next(ok, None)
            if data_row is None:
                raise ValueError("the stage answered fewer rows than sessions that succeeded")
            row = Row(bytes(data_row), dtype, shape)
        out.append((result, row))
    return out


def token_row(token: int) -> Row:
    """Stage 0's row of a decode step: the session's last token."""
    return Row(struct.pack("<q", token), "I64", (1,))
