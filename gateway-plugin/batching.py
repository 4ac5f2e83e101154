"""Dynamic batching of one-shot passes at the router's stage queues (docs/batching.md).

When a replica of a stage is free, :meth:`Batcher.gather` takes, beside the request at the head of the
stage's queue, the requests waiting behind it that can share one call, nearest in length first (up to the function's
``com.quart.batch.max``, default ``QUART_BATCH_MAX`` = 1 = off): bodies that are safetensors activations
with the same tensor names, dtypes and widths, for the whole stage (no layer sub-range), and no JSON
answer asked of this call. :func:`pack` lays one-sequence requests (one row, no mask of their own) end to end
in one row of their total length with ``segment_lengths`` (a packed batch: no padding; the stage restarts
positions and runs attention per sequence, quart_stage.ragged); requests of several rows or with their own
mask are padded on the right to the longest sequence and concatenated along the batch dimension, with an
``attention_mask``. :func:`split` cuts the stage's output back into each request's positions (or rows of a
pooled [rows, features] output; its own mask kept, none added), and each request continues alone to the next
stage's queue (:meth:`Router.settle`). Either way every request's outputs are those of a run alone.

Per-request errors stay per request: a body the router cannot parse goes alone (the stage answers its
own 400); a batch the stage refuses (a 4xx, a 500) or answers in a shape that does not split is re-run
one request at a time; a batch call that failed on the way (timeout, connection) is retried per request
by the router's one retry rule. ``com.quart.batch.wait-ms`` (default ``QUART_BATCH_WAIT_MS`` = 0) holds a
batch smaller than its maximum that long for more arrivals; 0 adds no wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gateway_plugin import layers
from quart_stage import labels as vocab
from quart_stage.errors import QuartError
from quart_transport.retry import passed_on

if TYPE_CHECKING:
    import torch

# the router's types (gateway_plugin.router imports this module, so they are named here, not imported)
Router = Job = StageQueue = Any

log = logging.getLogger("quart.batching")
ATTENTION_MASK = "attention_mask"  # quart_stage.inputs.ATTENTION_MASK (torch and the wire format load on first use)
SEGMENT_LENGTHS = "segment_lengths"  # quart_stage.inputs.SEGMENT_LENGTHS: a packed batch's sequence lengths
SAFETENSORS = "application/octet-stream"  # quart_stage.SAFETENSORS

__all__ = ["BatchLimits", "Batcher", "Exchange", "Member", "limits_from_labels", "pack", "split"]


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """How a stage function batches: at most ``max`` requests per call, a short batch held ``wait_s`` for more."""

    max: int = 1
    wait_s: float = 0.0
    profile_s: tuple[tuple[int, float], ...] = ()  # profiled (size, service s) of one call (policies' prior)


def limits_from_labels(labels: Mapping[str, str], default: BatchLimits) -> BatchLimits:
    """``com.quart.batch.max`` / ``wait-ms`` / ``profile-ms`` of a function, ``default`` where absent or malformed."""
    try:
        return BatchLimits(vocab.label_int(labels, vocab.BATCH_MAX, default.max, minimum=1),
                           vocab.label_float(labels, vocab.BATCH_WAIT_MS, 1000 * default.wait_s) / 1000,
                           parse_profile(labels.get(vocab.BATCH_PROFILE_MS, "")) or default.profile_s)
    except QuartError:
        return default


def parse_profile(text: str) -> tuple[tuple[int, float], ...]:
    """``"1:23,4:40,16:100"`` (batch size: ms of one call) as ((size, seconds), …); "" → (). Malformed → QuartError."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        size, _, ms = item.partition(":")
        try:
            row = (int(size), float(ms) / 1000)
        except ValueError:
            row = (0, 0.0)
        if row[0] < 1 or not row[1] > 0 or row[1] == float("inf"):
            raise QuartError(400, f"{vocab.BATCH_PROFILE_MS}: expected 'size:ms,…' with sizes ≥ 1 and ms > 0, "
                                  f"got {text!r}")
        out.append(row)
    return tuple(sorted(out))


def batch_state(limits: BatchLimits) -> dict[str, Any]:
    """The ``StageState`` fields (gateway_plugin.snapshot_builder) a stage's batch limits give the policies."""
    return {"batch_max": limits.max, "batch_profile_s": limits.profile_s}


@dataclass(slots=True)
class Exchange:
    """One stage call's outcome (the router's, batched or not): times, the answer, or why it failed."""

    start: float
    end: float
    status: int
    data: bytes
    headers: Mapping[str, str]
    failure: str = ""
    error: BaseException | None = None
    size: int = 1  # requests it carried


@dataclass(slots=True)
class Member:
    """One request's share of a batch: its tensors (mask apart), rows, sequence length, whether it sent a mask."""

    tensors: dict[str, torch.Tensor]
    mask: torch.Tensor | None
    rows: int
    length: int

    @property
    def key(self) -> tuple:
        """What must agree across a batch: tensor names, dtypes and every dimension past the sequence."""
        return tuple((n, t.dtype, tuple(t.shape[2:])) for n, t in sorted(self.tensors.items())) + (
            None if self.mask is None else self.mask.dtype,)


def json_answer(job: Job) -> bool:
    """Whether this call must answer JSON (the last stage, a client that asked for it: as the stage decides)."""
    return job.stage == len(job.stages) - 1 and "application/json" in job.accept and SAFETENSORS not in job.accept


def member_of(body: bytes, content_type: str) -> Member | None:
    """``body`` as a batch member, or None when it must go alone (not safetensors, malformed, not [rows, seq, ...])."""
    if content_type.split(";")[0].strip().lower() not in ("", SAFETENSORS):
        return None
    from quart_stage import wire
    try:
        tensors = dict(wire.decode(body).tensors)
    except QuartError:
        return None
    mask = tensors.pop(ATTENTION_MASK, None)
    if not tensors or SEGMENT_LENGTHS in tensors or any(t.dim() < 2 for t in tensors.values()):
        return None
    rows, length = next(iter(tensors.values())).shape[:2]
    if any(tuple(t.shape[:2]) != (rows, length) for t in tensors.values()) or rows == 0 or length == 0:
        return None
    if mask is not None and tuple(mask.shape) != (rows, length):
        return None
    return Member(tensors, mask, int(rows), int(length))


def member_for(job: Job) -> Member | None:
    """:func:`member_of` the job's body at its current stage, parsed once: a waiting request is looked at by every
    batch formed while it waits (up to 4 × max of the queue each time), its body does not change until it moves on."""
    memo = job.member
    if memo is not None and memo[0] is job.body:
        return memo[1]
    member = member_of(job.body, job.content_type)
    job.member = (job.body, member)
    return member


def packable(members: list[Member]) -> bool:
    """Whether a batch goes packed (every member one sequence without a mask of its own) rather than padded."""
    return all(m.rows == 1 and m.mask is None for m in members)


def pack(members: list[Member], metadata: Mapping[str, str]) -> bytes:
    """One safetensors body: :func:`packable` members end to end in one row with their ``segment_lengths``; else
    every tensor right-padded with zeros to the longest sequence and concatenated on the batch dimension, with an
    ``attention_mask`` when lengths differ or any member sent one."""
    import torch
    from quart_stage import wire
    if packable(members):
        out = {name: torch.cat([m.tensors[name] for m in members], dim=1) for name in members[0].tensors}
        out[SEGMENT_LENGTHS] = torch.tensor([m.length for m in members], dtype=torch.int64)
        return wire.encode_bytes(out, metadata)
    longest = max(m.length for m in members)
    out: dict[str, torch.Tensor] = {}
    for name, first in members[0].tensors.items():
        total = sum(m.rows for m in members)
        batch = torch.zeros((total, longest, *first.shape[2:]), dtype=first.dtype)
        row = 0
        for m in members:
            batch[row:row + m.rows, :m.length] = m.tensors[name]
            row += m.rows
        out[name] = batch
    if any(m.mask is not None or m.length != longest for m in members):
        dtype = next((m.mask.dtype for m in members if m.mask is not None), torch.int64)
        mask = torch.zeros((sum(m.rows for m in members), longest), dtype=dtype)
        row = 0
        for m in members:
            mask[row:row + m.rows, :m.length] = 1 if m.mask is None else m.mask
            row += m.rows
        out[ATTENTION_MASK] = mask
    return wire.encode_bytes(out, metadata)


def split(answer: bytes, members: list[Member], request_ids: list[str]) -> list[bytes]:
    """The stage's answer to a packed batch as one safetensors body per member: of a tensor of rank ≥ 3
    ([rows, positions, …]: hidden states, logits) its rows and positions, of a rank-2 one ([rows, features]: a
    pooled embedding) its rows; its own mask. ValueError when the answer does not have the batch's shape."""
    from quart_stage import wire

    decoded = wire.decode(answer)
    tensors = {n: t for n, t in decoded.tensors.items() if n not in (ATTENTION_MASK, SEGMENT_LENGTHS)}
    if packable(members):  # [1, total positions, …] cut by positions; a pooled [rows, features] by rows
        return _split_packed(tensors, members, decoded.metadata, request_ids)
    rows, longest = sum(m.rows for m in members), max(m.length for m in members)
    if not tensors or any(t.dim() < 2 or t.shape[0] != rows or (t.dim() > 2 and t.shape[1] != longest)
                          for t in tensors.values()):
        raise ValueError(f"a batch of {rows} rows × {longest} positions was answered with shapes "
                         f"{ {n: list(t.shape) for n, t in tensors.items()} }")
    pieces, row = [], 0
    for m, request_id in zip(members, request_ids, strict=True):
        own = {n: t[row:row + m.rows, :m.length] if t.dim() > 2 else t[row:row + m.rows] for n, t in tensors.items()}
        if m.mask is not None:
            own[ATTENTION_MASK] = m.mask
        pieces.append(wire.encode_bytes(own, {**decoded.metadata, "request_id": request_id}))
        row += m.rows
    return pieces


def _split_packed(tensors: Mapping[str, torch.Tensor], members: list[Member], metadata: Mapping[str, str],
                  request_ids: list[str]) -> list[bytes]:
    from quart_stage import wire

    total = sum(m.length for m in members)
    if not tensors or any(t.dim() < 2 or (t.shape[:2] != (1, total) if t.dim() > 2 else t.shape[0] != len(members))
                          for t in tensors.values()):
        raise ValueError(f"a packed batch of {len(members)} sequences, {total} positions, was answered with shapes "
                         f"{ {n: list(t.shape) for n, t in tensors.items()} }")
    pieces, at = [], 0
    for k, (m, request_id) in enumerate(zip(members, request_ids, strict=True)):
        own = {n: t[:, at:at + m.length] if t.dim() > 2 else t[k:k + 1] for n, t in tensors.items()}
        pieces.append(wire.encode_bytes(own, {**metadata, "request_id": request_id}))
        at += m.length
    return pieces


class Batcher:
    """The router's batching: which waiting requests join a call, the batched call, its split."""

    def __init__(self, router: Router, limits: Callable[[str], BatchLimits]) -> None:
        self.router = router
        self.limits = limits
        self.tasks: set[asyncio.Task] = set()

    def gather(self, q: StageQueue, job: Job, replica: Any) -> list[tuple[Job, Member]]:
        """``job`` and the queued requests that join it on ``replica`` (taken off the queue); [] = ``job`` alone."""
        limits = self.limits(q.function)
        if limits.max <= 1 or not self.eligible(job, replica):
            return []
        head = member_for(job)
        if head is None:
            return []
        chosen = [(job, head)]
        self._more(q, chosen, limits.max)
        return chosen if len(chosen) > 1 or limits.wait_s > 0 else []

    def eligible(self, job: Job, replica: Any) -> bool:
        return not job.solo and not json_answer(job) and job.layer_at is None and layers.part_for(replica, None) is None

    def _more(self, q: StageQueue, chosen: list[tuple[Job, Member]], most: int) -> None:
        """Add to ``chosen`` the compatible queued requests, in queue order when they pack, else those whose lengths
        are nearest the head's (padding is compute spent on nothing), scanning at most 4 × ``most`` of the queue."""
        head, now = chosen[0][1], self.router.clock()
        nearest = not packable([head])
        found = []
        for other in itertools.islice(q.jobs, 4 * most):
            if other.done or other.solo or other.layer_at is not None or now >= other.deadline or json_answer(other):
                continue
            member = member_for(other)
            if member is not None and member.key == head.key:
                found.append((abs(member.length - head.length) if nearest else 0, len(found), other, member))
        for _, _, other, member in sorted(found)[: most - len(chosen)]:
            q.jobs.remove(other)
            chosen.append((other, member))

    def launch(self, q: StageQueue, chosen: list[tuple[Job, Member]], replica: Any) -> None:
        """The batched call of ``chosen`` on ``replica`` (its slot taken), as a task the router's close cancels."""
        for job, _ in chosen:
            job.attempts += 1
            self.router._running.add(job)
        task = asyncio.get_running_loop().create_task(self.run(q, chosen, replica))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, q: StageQueue, chosen: list[tuple[Job, Member]], replica: Any) -> None:
        router, called = self.router, False
        try:
            limits = self.limits(q.function)
            if limits.wait_s > 0 and len(chosen) < limits.max:  # hold a short batch for more arrivals
                await asyncio.sleep(max(0.0, min(limits.wait_s, min(j.deadline for j, _ in chosen) - router.clock())))
                self._more(q, chosen, limits.max)
            live = [(j, m) for j, m in chosen if not j.done]
            jobs, members = [j for j, _ in live], [m for _, m in live]
            if not jobs:
                return
            head = jobs[0]
            meta = {"model": head.model, "stage": str(head.stage)}
            sent = {"Content-Type": SAFETENSORS, "X-Quart-Request-Id": f"{head.id}+{len(jobs) - 1}",
                    "X-Quart-Model": head.model, "X-Quart-Stage": str(head.stage)}
            start, body, called = router.clock(), pack(members, meta), True
            done = await router.exchange(q, replica, sent, body, max(j.deadline for j in jobs), start)
            self.settle(q, replica, jobs, members, done)
        except Exception as exc:  # noqa: BLE001 - a batch the router could not build: each request alone
            if called:
                raise
            log.warning("a batch for %s failed before its call (%s); its requests go one at a time", q.function, exc)
            self.alone(router, [j for j, _ in chosen])
        finally:
            if not called:  # the slot _launch took, never used by a call
                q.busy -= 1
                router.source.give_back(q.function, replica)
                q.wake.set()
            for job, _ in chosen:
                router._running.discard(job)
            router.hand_off(q)  # the freed replica to the queue's head (after the retries went back in front)

    @staticmethod
    def alone(router: Router, jobs: list[Job]) -> None:
        """Back to the front of their queue, each to be sent alone (their attempt not counted)."""
        for job in reversed(jobs):
            if not job.done:
                job.solo = True
                job.attempts -= 1
                router._enqueue(job, front=True)

    def settle(self, q: StageQueue, replica: Any, jobs: list[Job], members: list[Member], done: Exchange) -> None:
        """Each request of a finished batch call on its way: its own output, a retry, or a run alone."""
        router = self.router
        ok = done.failure == "" and 200 <= done.status < 300
        if ok:
            try:
                pieces = split(done.data, members, [j.id for j in jobs])
            except (QuartError, ValueError):
                pieces = None
            if pieces is not None:
                router.collector.stage(q.function).on_batch(len(jobs), done.end - done.start)
                for job, piece in zip(jobs, pieces, strict=True):
                    router.settle(job, q, replica, None, replace(done, data=piece, size=len(jobs)))
                return
        if ok or passed_on(done.status, done.error):  # the batch's answer, not one request's: each alone
            self.alone(router, jobs)
            return
        for job in jobs:  # failed on the way: the router's one retry rule, per request
            router.settle(job, q, replica, None, replace(done, size=len(jobs)))

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
