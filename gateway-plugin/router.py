"""The pipeline router: ``POST /function/<model>`` runs every stage of the model in order.

Each stage function has a FIFO queue. A per-stage dispatcher hands the head of the queue to the replica
the provider's one pick rule names (:func:`quart_provider.balancer.pick`, the same as the gateway's
proxy: least in flight among ready replicas with a free slot, concurrency 0 = unlimited), and carries
the stage's output (safetensors bytes) to the next stage's queue: a replica never calls its
successor. A failed or timed-out stage call is retried on another replica while the request's
deadline allows, otherwise the client gets an explicit 5xx JSON error. A request that finds a stage
queue at its cap is refused with 429 + Retry-After before it is accepted. Every accepted request
ends with exactly one response.

Replicas come from a ``ReplicaSource``: the embedded gateway's live replica sets (plugin.py) or a
fixed list (``StaticReplicas``: tests, or function-level dispatch to a real OpenFaaS gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from gateway_plugin import layers
from gateway_plugin.config import PluginConfig
from gateway_plugin.entry import entry_admission
from gateway_plugin.metrics import MetricsCollector, RequestRecord, StageVisit
from gateway_plugin.retry import passed_on, replica_gone, should_retry
from quart_provider.balancer import pick
from quart_provider.dead_peer import dead_peer_connector
from quart_provider.tracing import CALL_ID

from keysmanager.aio import wait_event, within

log = logging.getLogger("quart.router")

TIMING_HEADERS = ("X-Quart-Deserialize-Ms", "X-Quart-Compute-Ms", "X-Quart-Serialize-Ms")


class ReplicaSource(Protocol):
    """Where a stage function's replicas are and how their slots are counted."""

    def ready(self, function: str) -> list[Any]: ...

    def concurrency(self, function: str) -> int: ...  # per replica; 0 = unlimited

    def take(self, function: str, replica: Any) -> None: ...

    def give_back(self, function: str, replica: Any) -> None: ...

    def note_held(self, function: str, replica: Any, held: layers.Range) -> None: ...  # its answer's Layers-Held


@dataclass(slots=True)
class StaticReplica:
    id: str
    url: str
    in_flight: int = 0
    layers: layers.Range | None = None  # its stage's layers, when it reports them (see gateway_plugin.layers)
    held: layers.Range | None = None  # the layers it can run now (None: all of its stage)


@dataclass(slots=True)
class StaticReplicas:
    """A replica list per function that the owner edits (tests; a fixed set of upstream URLs)."""

    replicas: dict[str, list[StaticReplica]] = field(default_factory=dict)
    slots: int = 1

    def ready(self, function: str) -> list[StaticReplica]:
        return list(self.replicas.get(function, ()))

    def concurrency(self, function: str) -> int:
        return self.slots

    def take(self, function: str, replica: StaticReplica) -> None:
        replica.in_flight += 1

    def give_back(self, function: str, replica: StaticReplica) -> None:
        replica.in_flight -= 1

    def note_held(self, function: str, replica: StaticReplica, held: layers.Range) -> None:
        replica.held = held


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    headers: Mapping[str, str]

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body, headers=dict(self.headers))


def json_reply(status: int, message: str, field_name: str | None = None, **headers: str) -> Reply:
    payload: dict[str, str] = {"error": message}
    if field_name:
        payload["field"] = field_name
    return Reply(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **headers})


@dataclass(slots=True, eq=False)  # identity semantics: jobs live in sets
class Job:
    """One accepted pipeline request travelling through the stages."""

    id: str
    model: str
    stages: list[str]
    body: bytes
    content_type: str
    arrival: float
    deadline: float
    future: asyncio.Future
    accept: str = ""  # the client's Accept header, for the last stage only (the others exchange safetensors)
    stage: int = 0
    layer_at: int | None = None  # the first layer of the stage not run yet; None at the stage's start
    enqueued_at: float = 0.0
    queue_len_seen: int = 0
    tried: set = field(default_factory=set)
    attempts: int = 0
    visits: list[StageVisit] = field(default_factory=list)
    task: asyncio.Task | None = None
    done: bool = False


@dataclass(slots=True)
class StageQueue:
    function: str
    jobs: deque = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    busy: int = 0
    dispatcher: asyncio.Task | None = None


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
        dispatch_poll_s: float = 0.02,
        on_call: Callable[[str, int, float], None] | None = None,
    ) -> None:
        self.source = source
        self.pipelines = pipelines
        self.config = config or PluginConfig()
        self.collector = collector or MetricsCollector(self.config.window_s)
        self.stage_meta = stage_meta or (lambda fn: (1.0, 0))  # function → (cpus, param bytes)
        self.clock = clock
        self.dispatch_poll_s = dispatch_poll_s
        self.on_call = on_call  # (function, HTTP status, seconds) per stage call: the gateway's invocation counters
        self.queues: dict[str, StageQueue] = {}
        self.session: aiohttp.ClientSession | None = None
        self._ids = itertools.count()
        self._closed = False
        self._running: set[Job] = set()
        self.accepted = 0
        self.answered = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                # a call in flight to a host that went silent fails in ~2 s and is retried elsewhere
                connector=dead_peer_connector(limit=0, enable_cleanup_closed=True),
                timeout=aiohttp.ClientTimeout(total=None),
            )

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
        if self.session is not None:
            await self.session.close()
            self.session = None

    def queue(self, function: str) -> StageQueue:
        q = self.queues.get(function)
        if q is None:
            q = self.queues[function] = StageQueue(function)
        if q.dispatcher is None or q.dispatcher.done():
            q.dispatcher = asyncio.get_running_loop().create_task(self._dispatch(q), name=f"dispatch:{function}")
        return q

    # ------------------------------------------------------------------ entry points

    async def handle(self, request: web.Request, model: str) -> web.StreamResponse:
        """aiohttp handler body for ``POST /function/<model>``; every answer carries the request's ``X-Call-Id``
        (the client's, else a new UUID4), which is also the request id unless ``X-Quart-Request-Id`` is sent."""
        call_id = request.headers.get(CALL_ID) or str(uuid.uuid4())
        response = (await self._handle(request, model, call_id)).response()
        response.headers[CALL_ID] = call_id
        return response

    async def _handle(self, request: web.Request, model: str, call_id: str) -> Reply:
        if request.method != "POST":
            return json_reply(405, f"use POST to invoke pipeline {model!r}", "method")
        body = await request.read()
        timeout = None
        raw = request.headers.get("X-Quart-Timeout-Ms")
        if raw:
            try:
                timeout = float(raw) / 1000.0
                if timeout <= 0:
                    raise ValueError
            except ValueError:
                return json_reply(400, f"X-Quart-Timeout-Ms must be a positive number, got {raw!r}",
                                  "X-Quart-Timeout-Ms")
        return await self.invoke(model, body, request.headers.get("Content-Type", "application/octet-stream"),
                                 timeout_s=timeout, request_id=request.headers.get("X-Quart-Request-Id") or call_id,
                                 accept=request.headers.get("Accept", ""))

    async def invoke(
        self, model: str, body: bytes, content_type: str = "application/octet-stream",
        timeout_s: float | None = None, request_id: str | None = None, accept: str = "",
    ) -> Reply:
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
        if hasattr(self.source, "scale_from_zero"):  # stages at zero start now, all of them (as OpenFaaS does)
            self.source.scale_from_zero(stages)
        self._enqueue(job, front=False)
        try:
            return await within(timeout + 0.5, asyncio.shield(job.future))
        except TimeoutError:
            self._abandon(job)
            return job.future.result()
        except asyncio.CancelledError:  # the client went away: stop the work, keep counters exact
            self._abandon(job, status=499)
            raise

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
            q.jobs.append(job)
        else:
            q.jobs.appendleft(job)
        q.wake.set()

    def _pick(self, function: str, tried: set, at: int | None = None) -> Any | None:
        """The pick rule over the replicas that can run the request's next layers (all of them, unless some
        replica holds only part of its stage: see :mod:`gateway_plugin.layers`)."""
        ready = [r for r in self.source.ready(function) if layers.eligible(r, at)]
        return pick(ready, self.source.concurrency(function), tried)

    async def _dispatch(self, q: StageQueue) -> None:
        while True:
            while q.jobs and q.jobs[0].done:
                q.jobs.popleft()
            if not q.jobs:
                q.wake.clear()
                await q.wake.wait()
                continue
            job = q.jobs[0]
            if self.clock() >= job.deadline:
                q.jobs.popleft()
                self._finish(job, self._deadline_reply(job, "waiting for a replica"))
                continue
            try:
                replica = self._pick(q.function, job.tried, job.layer_at)
            except Exception as exc:  # the platform's replica view failed: keep serving, retry soon
                log.warning("listing replicas of %s failed: %s", q.function, exc)
                replica = None
            if replica is None:
                q.wake.clear()
                await wait_event(q.wake, self.dispatch_poll_s)
                continue
            q.jobs.popleft()
            self.source.take(q.function, replica)
            q.busy += 1
            job.attempts += 1
            job.task = asyncio.get_running_loop().create_task(self._call(job, q, replica))
            self._running.add(job)
            job.task.add_done_callback(lambda _t, job=job: self._running.discard(job))

    async def _call(self, job: Job, q: StageQueue, replica: Any) -> None:
        fn = q.function
        start = self.clock()
        wait_s = start - job.enqueued_at
        status, data, headers, failure = 0, b"", {}, ""
        part: layers.Range | None = None
        error: BaseException | None = None
        try:
            timeout = min(self.config.attempt_timeout_s, job.deadline - start)
            if self.session is None:
                raise aiohttp.ClientError("the router's HTTP client is closed")
            sent = {"Content-Type": job.content_type, "X-Quart-Request-Id": job.id,
                    "X-Quart-Model": job.model, "X-Quart-Stage": str(job.stage)}
            part = layers.part_for(replica, job.layer_at)
            if part is not None:
                sent[layers.LAYERS] = layers.format_range(part)
            stage_end = part is None or layers.next_position(part, layers.stage_range(replica)) is None
            if job.accept and job.stage == len(job.stages) - 1 and stage_end:
                sent["Accept"] = job.accept  # e.g. application/json: the client's format for the final answer
            async with self.session.post(
                replica.url, data=job.body, headers=sent,
                timeout=aiohttp.ClientTimeout(total=max(0.001, timeout)),
            ) as resp:
                data = await resp.read()
                status, headers = resp.status, dict(resp.headers)
            held = layers.parse_range(headers.get(layers.HELD))
            if held is not None and held != getattr(replica, "held", None):
                self.source.note_held(fn, replica, held)
        except asyncio.CancelledError:
            failure = "cancelled"
            raise
        except Exception as exc:  # timeout, connection, protocol, closed client: all count as a failed attempt
            error = exc
            failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            status = 504 if isinstance(exc, TimeoutError) else 502  # what the gateway's proxy would count
        finally:
            q.busy -= 1
            self.source.give_back(fn, replica)
            q.wake.set()
            job.task = None
        end = self.clock()
        if self.on_call is not None:
            try:
                self.on_call(fn, status, end - start)
            except Exception as exc:  # counting must never fail a request
                log.warning("recording the call to %s failed: %s", fn, exc)
        if job.done:
            return
        if failure == "" and 200 <= status < 300:
            service_s = end - start
            ran = layers.parse_range(headers.get(layers.LAYERS)) or part
            stats = self.collector.stage(fn)
            stats.on_dispatch(start, wait_s)
            rest = layers.next_position(ran, layers.stage_range(replica)) if part is not None else None
            if rest is None:
                stats.on_complete(end, service_s)  # a stage run in parts completes once, with its last part
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
                self._finish(job, Reply(200, data, out))
            else:
                job.stage += 1
                self._enqueue(job, front=False)
            return
        if passed_on(status, error):  # a 4xx, a stage's 500: the same on every replica (gateway_plugin.retry)
            self._finish(job, Reply(status, data, {"Content-Type": headers.get("Content-Type", "application/json")}))
            return
        why = failure or f"HTTP {status}"
        job.tried.add(replica.id)
        if replica_gone(error) and hasattr(self.source, "mark_unreachable"):  # dead: never picked again
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

    def _deadline_reply(self, job: Job, doing: str) -> Reply:
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

    def _finish(self, job: Job, reply: Reply) -> None:
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
        q = self.queues.get(function)
        return sum(1 for j in q.jobs if not j.done) if q else 0

    def busy(self, function: str) -> int:
        q = self.queues.get(function)
        return q.busy if q else 0


def _ms(headers: Mapping[str, str], name: str) -> float:
    try:
        return float(headers.get(name, 0.0))
    except ValueError:
        return 0.0
