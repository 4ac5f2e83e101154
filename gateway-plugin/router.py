"""The pipeline router: ``POST /function/<model>`` runs every stage of the model in order.

Each stage function has one FIFO queue. A per-stage dispatcher hands the head of the queue to the replica the
provider's one pick rule names (:func:`quart_kernel.picking.pick`: least in flight among ready replicas with
a free slot) and carries the stage's output (safetensors) to the next stage's queue: a replica never calls its
successor. With ``com.quart.batch.max`` > 1 the waiting requests that fit go in one call
(:mod:`gateway_plugin.batching`). A failed or timed-out call is retried on another replica while the deadline
allows (:mod:`quart_transport.retry`), else the client gets an explicit 5xx; a request that finds a stage queue at
its cap is refused with 429 + Retry-After before it is accepted (``entry.py``). Every accepted request ends with
exactly one response. The embedded gateway's fast front calls :meth:`Router.answer` with the body read; stage
calls go through the client ``quart_transport.codec.upstream_pool`` makes (lean, or aiohttp); a dispatcher with no
free replica waits on :meth:`ReplicaSource.wait`, resolved by any release or a replica becoming ready — no polling
(docs/architecture.md, "One request"). Replicas come from a ``ReplicaSource`` (plugin.py's live replica sets, or
``StaticReplicas``); engines beside the router reuse it, :meth:`Router.pick` and ``Router.upstream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from aiohttp import web
from gateway_plugin import layers
from gateway_plugin.batching import Batcher, BatchLimits, Exchange
from gateway_plugin.config import PluginConfig
from gateway_plugin.entry import entry_admission, queued_verdict
from gateway_plugin.jobs import Head, Job, StageQueue
from gateway_plugin.metrics import MetricsCollector, RequestRecord, StageVisit
from gateway_plugin.ports import Replica, ReplicaSource
from gateway_plugin.replicas import StaticReplica, StaticReplicas, Waiters
from quart_kernel.admission import ServiceTimes, client_deadline_s
from quart_kernel.picking import pick
from quart_kernel.shedding import SHED_HEADER
from quart_stage.errors import QuartError
from quart_transport.codec import upstream_pool
from quart_transport.responses import Answer, answer_of
from quart_transport.retry import passed_on, replica_gone, should_retry
from quart_transport.tracing import CALL_ID, new_call_id
from quart_transport.upstream import Upstream, UpstreamTimeout

log = logging.getLogger("quart.router")

TIMING_HEADERS = ("X-Quart-Deserialize-Ms", "X-Quart-Compute-Ms", "X-Quart-Serialize-Ms")


__all__ = ["Head", "Job", "ReplicaSource", "Reply", "Router", "StageQueue", "StaticReplica", "StaticReplicas", "Waiters",
           "json_reply"]

Reply = Answer  # what the router answers: status, headers, body (quart_transport.responses.Answer)


def json_reply(status: int, message: str, field_name: str | None = None, **headers: str) -> Answer:
    """An error answer: the :class:`QuartError` body (``{"error", "field"}``) with ``headers``."""
    return answer_of(QuartError(status, message, field_name, headers), retry_after_s=1)


def web_response(answer: Answer) -> web.Response:
    return web.Response(status=answer.status, body=answer.body, headers=answer.headers)


class Router:
    """Per-stage queues and dispatchers for every pipeline ``pipelines()`` names."""

    def __init__(
        self,
        source: ReplicaSource,
        pipelines: Callable[[], dict[str, list[str]]],
        config: PluginConfig | None = None,
        collector: MetricsCollector | None = None,
        stage_meta: Callable[[str], tuple[float, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        dispatch_poll_s: float = 0.25,
        on_call: Callable[[str, int, float], None] | None = None,
        batch_limits: Callable[[str], BatchLimits] | None = None,
    ) -> None:
        self.source = source
        self.pipelines = pipelines
        self.config = config or PluginConfig()
        self.collector = collector or MetricsCollector(self.config.window_s)
        self.stage_meta = stage_meta or (lambda fn: (1.0, 0))  # function → (cpus, param bytes)
        self.clock = clock
        self.dispatch_poll_s = dispatch_poll_s  # a safety bound on a wait for a replica: a release wakes it
        self.on_call = on_call  # (function, HTTP status, seconds) per stage call: the gateway's invocation counters
        self.queues: dict[str, StageQueue] = {}
        self.upstream: Upstream | None = None  # the lean client to replicas (keep-alive, dead-peer sockets)
        self._targets: dict[str, tuple[str, str]] = {}  # replica url -> (base url, path)
        self._ids = itertools.count()
        self._closed = False
        self._running: set[Job] = set()
        default = BatchLimits(self.config.batch_max, self.config.batch_wait_ms / 1000)
        self.batcher = Batcher(self, batch_limits or (lambda fn: default))  # com.quart.batch.max per function
        self.accepted = 0
        self.answered = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.upstream is None:  # a call in flight to a host that went silent fails in ~2 s, retried elsewhere
            self.upstream = upstream_pool(self.config.attempt_timeout_s, keepalive_s=60)

    async def close(self) -> None:
        """Answer every queued or running request with 503, stop dispatchers, close the client."""
        self._closed = True
        for q in self.queues.values():
            if q.dispatcher:
                q.dispatcher.cancel()
            while q.jobs:
                job = q.jobs.popleft()
                self._finish(job, json_reply(503, "the router is shutting down"))
        for job in list(self._running):
            self._finish(job, json_reply(503, "the router is shutting down"))
            if job.task is not None:
                job.task.cancel()
        for q in self.queues.values():
            if q.dispatcher:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await q.dispatcher
        await self.batcher.close()
        if self.upstream is not None:
            await self.upstream.close()
            self.upstream = None

    def queue(self, function: str) -> StageQueue:
        q = self.queues.get(function)
        if q is None:
            q = self.queues[function] = StageQueue(function)
        if q.dispatcher is None or q.dispatcher.done():
            q.dispatcher = asyncio.get_running_loop().create_task(self._dispatch(q), name=f"dispatch:{function}")
        return q

    # ------------------------------------------------------------------ entry points

    async def handle(self, request: web.Request, model: str) -> web.StreamResponse:
        """aiohttp handler body for ``POST /function/<model>`` (the standalone plugin; the embedded gateway
        calls :meth:`answer` from its fast front)."""
        body = await request.read() if request.method == "POST" else b""
        return web_response(await self.answer(model, request.method, "", request.headers, body))

    async def answer(self, model: str, method: str, tail: str, headers: Mapping[str, str], body: bytes) -> Answer:
        """``method /function/<model>[/<tail>]`` with ``headers`` and the whole ``body``; every answer carries the
        request's ``X-Call-Id`` (the client's, else a new one), which is also the request id unless
        ``X-Quart-Request-Id`` is sent."""
        call_id = headers.get(CALL_ID) or new_call_id()
        answer = await self._answer(model, method, tail, headers, body, call_id)
        answer.headers[CALL_ID] = call_id
        return answer

    async def _answer(self, model: str, method: str, tail: str, headers: Mapping[str, str], body: bytes,
                      call_id: str) -> Answer:
        if tail:
            return json_reply(404, f"pipeline {model!r} has no sub-path {tail!r}", "path")
        if method != "POST":
            return json_reply(405, f"use POST to invoke pipeline {model!r}", "method")
        try:
            timeout = client_deadline_s(headers, self.config.request_timeout_s)
        except QuartError as exc:
            return answer_of(exc, self.config.retry_after_s)
        return await self.invoke(model, body, headers.get("Content-Type", "application/octet-stream"),
                                 timeout_s=timeout, request_id=headers.get("X-Quart-Request-Id") or call_id,
                                 accept=headers.get("Accept", ""))

    async def invoke(
        self, model: str, body: bytes, content_type: str = "application/octet-stream",
        timeout_s: float | None = None, request_id: str | None = None, accept: str = "",
    ) -> Answer:
        if self._closed:
            return json_reply(503, "the router is shutting down", None, **{"Retry-After": str(self.config.retry_after_s)})
        stages = self.pipelines().get(model)
        if not stages:
            return json_reply(404, f"no pipeline named {model!r} is deployed", "model")
        await self.start()
        timeout = min(timeout_s or self.config.request_timeout_s, self.config.request_timeout_s)
        verdict = entry_admission(self, model, stages, timeout)  # queue cap, expected wait vs deadline
        if not verdict.admit and verdict.status != 429:  # a deadline no load could meet
            return json_reply(verdict.status, verdict.reason, "X-Quart-Timeout-Ms")
        if not verdict.admit:
            return json_reply(429, verdict.reason, None, **{"Retry-After": str(verdict.retry_after_s)})
        now = self.clock()
        job = Job(
            id=request_id or f"{uuid.uuid4().hex[:12]}-{next(self._ids)}",
            model=model, stages=list(stages), body=body, content_type=content_type,
            arrival=now, deadline=now + timeout, future=asyncio.get_running_loop().create_future(), accept=accept,
        )
        self.accepted += 1
        self.source.scale_from_zero(stages)  # stages at zero start now, all of them (as OpenFaaS does)
        self._enqueue(job, front=False)
        timer = asyncio.get_running_loop().call_later(timeout + 0.5, self._abandon, job)  # answers it 504
        try:
            return await job.future
        except asyncio.CancelledError:  # the client went away: stop the work, keep counters exact
            self._abandon(job, status=499)
            raise
        finally:
            timer.cancel()

    # ------------------------------------------------------------------ internals

    def _enqueue(self, job: Job, front: bool) -> None:
        fn = job.stages[job.stage]
        q = self.queue(fn)
        now = self.clock()
        if not front:
            job.enqueued_at = now
            job.queue_len_seen = len(q.jobs)
            job.tried = set()
            job.attempts = 0
            self.collector.stage(fn).on_arrival(now, len(job.body))
        if q.parked and not q.jobs and now < job.deadline:  # nobody ahead: to a free replica now, if one is
            replica = self._free_replica(q, job)
            if replica is not None:
                self._launch(q, job, replica)
                return
        if front:
            q.jobs.appendleft(job)
        else:
            q.jobs.append(job)
        q.wake.set()

    def _free_replica(self, q: StageQueue, job: Job) -> Replica | None:
        try:
            return self.pick(q.function, job.tried, job.layer_at)
        except Exception as exc:  # the platform's replica view failed: keep serving, retry soon
            log.warning("listing replicas of %s failed: %s", q.function, exc)
            return None

    def _launch(self, q: StageQueue, job: Job, replica: Replica) -> None:
        """The stage call of ``job`` on ``replica`` (its slot taken), as a task."""
        self.source.take(q.function, replica)
        q.busy += 1
        if batch := self.batcher.gather(q, job, replica):  # the waiting requests that join this call, if it batches
            return self.batcher.launch(q, batch, replica)
        job.attempts += 1
        job.began = False
        job.task = asyncio.get_running_loop().create_task(self._call(job, q, replica))
        self._running.add(job)
        job.task.add_done_callback(lambda task, job=job: self._ended(q, job, replica, task))

    def _ended(self, q: StageQueue, job: Job, replica: Replica, task: asyncio.Task) -> None:
        """A call's task is over; one cancelled before it ran (the client gone, its deadline, in the launch's own
        turn) never reached :meth:`exchange`, so its slot is given back here."""
        self._running.discard(job)
        if task.cancelled() and not job.began:
            q.busy -= 1
            self.source.give_back(q.function, replica)
            q.wake.set()

    def pick(self, function: str, tried: set, at: int | None = None) -> Replica | None:
        """The pick rule over the replicas that can run the request's next layers (all of them, unless some
        replica holds only part of its stage: see :mod:`gateway_plugin.layers`)."""
        ready = [r for r in self.source.ready(function) if layers.eligible(r, at)]
        return pick(ready, self.source.concurrency(function), tried)

    async def _dispatch(self, q: StageQueue) -> None:
        """The stage's dispatcher: serves the head whenever a replica may have become free for it by something
        this router does not see end (a replica ready, a proxy call released, a pick that skipped a replica)."""
        while True:
            served = self.serve_head(q)
            if served is Head.EMPTY:
                q.wake.clear()
                q.parked = True
                try:
                    await q.wake.wait()
                finally:
                    q.parked = False
            elif served is Head.NO_REPLICA:  # wait for a release or a new replica (the router's, the proxy's, ...)
                q.wake.clear()
                await self._wait_slot(q)

    def serve_head(self, q: StageQueue) -> Head:
        """The head of ``q``'s queue takes a free replica: the one path of every dispatch (the dispatcher's loop,
        :meth:`hand_off`). Done jobs are dropped, a head past its deadline answered 504, one that can no longer
        meet it shed 429 (:func:`queued_verdict`); the first that stays goes to the replica the pick rule names,
        with the waiting requests that batch with it. At most one call is launched."""
        while q.jobs:
            job = q.jobs[0]
            if job.done:
                q.jobs.popleft()
                continue
            if self.clock() >= job.deadline:
                q.jobs.popleft()
                self._finish(job, self._deadline_reply(job, "waiting for a replica"))
                continue
            if not (keep := queued_verdict(self, job)).admit:  # its deadline can no longer be met: 429 now
                q.jobs.popleft()
                self._finish(job, json_reply(429, keep.reason, None, **{"Retry-After": str(keep.retry_after_s),
                                                                        SHED_HEADER: "deadline"}))
                continue
            replica = self._free_replica(q, job)
            if replica is None:
                return Head.NO_REPLICA
            q.jobs.popleft()
            self._launch(q, job, replica)
            return Head.LAUNCHED
        return Head.EMPTY

    def hand_off(self, q: StageQueue) -> None:
        """A call of ``q``'s stage ended and its request was settled (a retry already back in front): the replica it
        freed goes to the queue's head now, in this event-loop turn, not at the dispatcher's wake-up (which
        then finds nothing to do). The new call starts as its own task: a call that ends at once never recurses."""
        if q.jobs and not self._closed:
            self.serve_head(q)

    def service_times(self, function: str) -> ServiceTimes:
        """The function's one service-time estimator (the source's, shared with the platform's proxy)."""
        return self.source.service_times(function)

    async def _wait_slot(self, q: StageQueue) -> None:
        released = self.source.wait(q.function)
        woken = asyncio.ensure_future(q.wake.wait())  # a job queued in front (a retry), the router closing
        try:
            await asyncio.wait((released, woken), timeout=self.dispatch_poll_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            released.cancel()

    def _target(self, url: str) -> tuple[str, str]:
        """A replica's url as (base url, path) for the upstream client."""
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            target = self._targets[url] = (f"{parts.scheme}://{parts.netloc}", path)
        return target

    async def _call(self, job: Job, q: StageQueue, replica: Replica) -> None:
        job.began = True
        start = self.clock()
        sent = {"Content-Type": job.content_type, "X-Quart-Request-Id": job.id,
                "X-Quart-Model": job.model, "X-Quart-Stage": str(job.stage)}
        part = layers.part_for(replica, job.layer_at)
        if part is not None:
            sent[layers.LAYERS] = layers.format_range(part)
        stage_end = part is None or layers.next_position(part, layers.stage_range(replica)) is None
        if job.accept and job.stage == len(job.stages) - 1 and stage_end:
            sent["Accept"] = job.accept  # e.g. application/json: the client's format for the final answer
        try:
            done = await self.exchange(q, replica, sent, job.body, job.deadline, start)
            job.task = None
            self.settle(job, q, replica, part, done)
        finally:  # answered, retried, moved on, or abandoned (cancelled): its replica to the head waiting now
            self.hand_off(q)

    async def exchange(self, q: StageQueue, replica: Replica, sent: dict[str, str], body: bytes, deadline: float,
                       start: float) -> Exchange:
        """One stage call on ``replica`` (its slot taken by :meth:`_launch`), the slot given back after it."""
        fn = q.function
        status, data, headers, failure = 0, b"", {}, ""
        error: BaseException | None = None
        try:
            timeout = min(self.config.attempt_timeout_s, deadline - start)
            if self.upstream is None:
                raise RuntimeError("the router's HTTP client is closed")
            base, path = self._target(replica.url)
            resp = await self.upstream.request("POST", base, path, sent, body, timeout_s=max(0.001, timeout))
            data, status, headers = resp.body, resp.status, resp.headers
            held = layers.parse_range(headers.get(layers.HELD))
            if held is not None and held != replica.held:
                self.source.note_held(fn, replica, held)
        except Exception as exc:  # timeout, connection, protocol, closed client: all count as a failed attempt
            error = exc
            failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            status = 504 if isinstance(exc, UpstreamTimeout | TimeoutError) else 502  # as the proxy counts it
        finally:
            q.busy -= 1
            self.source.give_back(fn, replica)
            q.wake.set()
        end = self.clock()
        if self.on_call is not None:
            try:
                self.on_call(fn, status, end - start)
            except Exception as exc:  # counting must never fail a request
                log.warning("recording the call to %s failed: %s", fn, exc)
        return Exchange(start, end, status, data, headers, failure, error)

    def settle(self, job: Job, q: StageQueue, replica: Replica, part: layers.Range | None, done: Exchange) -> None:
        """What a stage call's answer means for ``job``: the next stage, the rest of this one, a retry, an answer."""
        fn, start, end, wait_s = q.function, done.start, done.end, done.start - job.enqueued_at
        status, data, headers, failure, error = done.status, done.data, done.headers, done.failure, done.error
        if job.done:
            return
        if failure == "" and 200 <= status < 300:
            service_s = end - start
            ran = layers.parse_range(headers.get(layers.LAYERS)) or part
            stats = self.collector.stage(fn)
            stats.on_dispatch(start, wait_s)
            rest = layers.next_position(ran, layers.stage_range(replica)) if part is not None else None
            if rest is None:
                if done.size == 1:
                    stats.on_batch(1, service_s)
                stats.on_complete(end, service_s)  # a stage run in parts completes once, with its last part
                self.service_times(fn).record(service_s)  # admission's estimator, shared with the proxy
            cpus, param_bytes = self.stage_meta(fn)
            job.visits.append(StageVisit(
                stage=job.stage, function=fn, wait_ms=1000 * wait_s, service_ms=1000 * service_s,
                compute_ms=_ms(headers, "X-Quart-Compute-Ms"),
                serde_ms=_ms(headers, "X-Quart-Deserialize-Ms") + _ms(headers, "X-Quart-Serialize-Ms"),
                replica=replica.id, attempts=job.attempts, queue_len=job.queue_len_seen, cpus=cpus,
                activation_bytes=len(job.body), param_bytes=param_bytes,
            ))
            job.body = data
            job.content_type = headers.get("Content-Type", "application/octet-stream")
            if rest is not None:  # cooperative execution: the rest of this stage's layers on another replica
                job.layer_at, job.tried, job.attempts = rest, set(), 0
                self._enqueue(job, front=True)
                return
            job.layer_at = None
            if job.stage + 1 == len(job.stages):
                out = {"Content-Type": job.content_type, "X-Quart-Request-Id": job.id}
                out.update({k: headers[k] for k in TIMING_HEADERS if k in headers})
                self._finish(job, Answer(200, out, data))
            else:
                job.stage += 1
                self._enqueue(job, front=False)
            return
        if passed_on(status, error):  # a 4xx, a stage's 500: the same on every replica (quart_transport.retry)
            self._finish(job, Answer(status, {"Content-Type": headers.get("Content-Type", "application/json")}, data))
            return
        why = failure or f"HTTP {status}"
        job.tried.add(replica.id)
        if replica_gone(error):  # dead: never picked again (until the platform says it is back)
            self.source.mark_unreachable(fn, replica)
        if should_retry(status, error) and job.attempts < self.config.max_attempts and end < job.deadline:
            log.info("stage %s replica %s failed (%s); retrying request %s", fn, replica.id, why, job.id)
            self._enqueue(job, front=True)
            return
        if end >= job.deadline:
            self._finish(job, self._deadline_reply(job, f"the last attempt failed: {why}"))
        else:
            self._finish(job, json_reply(502, f"stage {fn!r} failed {job.attempts} time(s) for request "
                                              f"{job.id}; last error: {why}", "stage"))

    def _deadline_reply(self, job: Job, doing: str) -> Answer:
        fn = job.stages[job.stage]
        return json_reply(504, f"request {job.id} passed its deadline at stage {job.stage} ({fn!r}), {doing}", "stage")

    def _abandon(self, job: Job, status: int = 504) -> None:
        if job.done:
            return
        fn = job.stages[job.stage]
        with contextlib.suppress(ValueError):
            self.queues[fn].jobs.remove(job)
        if job.task is not None:
            job.task.cancel()
        reply = self._deadline_reply(job, "in the pipeline") if status == 504 else json_reply(status, "client closed the request")
        self._finish(job, reply)

    def _finish(self, job: Job, reply: Answer) -> None:
        if job.done:
            return
        job.done = True
        self.answered += 1
        if not job.future.done():
            job.future.set_result(reply)
        end = self.clock()
        error = ""
        if reply.status >= 400:
            with contextlib.suppress(Exception):
                error = json.loads(reply.body).get("error", "")
        self.collector.record(RequestRecord(
            id=job.id, model=job.model, arrival=job.arrival, end=end, status=reply.status,
            latency_ms=1000 * (end - job.arrival), stages=job.visits, error=error,
        ))

    # ------------------------------------------------------------------ state for the snapshot builder

    def queue_len(self, function: str) -> int:
        """What waits for a replica of ``function``: this router's stage queue, and the proxy's calls of the
        function waiting for a slot (``waiting`` of the source: 0 where it has no proxy)."""
        q = self.queues.get(function)
        return (sum(1 for j in q.jobs if not j.done) if q else 0) + self.source.waiting(function)

    def busy(self, function: str) -> int:
        q = self.queues.get(function)
        return q.busy if q else 0


def _ms(headers: Mapping[str, str], name: str) -> float:
    with contextlib.suppress(ValueError):
        return float(headers.get(name, 0.0))
    return 0.0
