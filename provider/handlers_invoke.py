"""Handlers of the data plane: ``/function/{name}`` (the proxy) and ``/async-function/{name}``.

The proxy hands a request to a replica the balancer picks, retrying once elsewhere when a replica
refuses the connection (it never saw the request: :mod:`quart_transport.retry`); a pipeline goes to the gateway's
pipeline route (the plugin's router, :meth:`InvokeHandlers.call_pipeline`), other names to the invoke
hooks. An async call is answered 202 + ``X-Call-Id`` once it is
stored in the durable queue (:mod:`.async_queue`; 503 while none is connected, or kept in memory with
``async_backend=memory``, :mod:`.async_calls`) and run later through this gateway's own ``/function``
path. Tracing
headers (:mod:`quart_transport.tracing`) go upstream here; :mod:`.routes` stamps them on every answer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from quart_kernel.admission import (
    Admission,
    RateMeter,
    StageLoad,
    admit_by_time,
    client_deadline_s,
)
from quart_kernel.shedding import SHED_HEADER, replica_wait_s
from quart_provider.async_calls import AsyncCall, AsyncInvoker
from quart_provider.async_queue import QueuedCall
from quart_provider.balancer import ServiceUnavailable
from quart_provider.bodies import read_body
from quart_provider.body_gate import Reservation
from quart_provider.callbacks import CALLBACK_HEADER, CallbackPolicy, CallbackSender
from quart_provider.gateway import EmbeddedGateway
from quart_provider.types import FunctionState
from quart_stage.errors import QuartError
from quart_transport import namespaces
from quart_transport.codec import upstream_pool
from quart_transport.headers import forwardable
from quart_transport.responses import Answer, answer_of, error_answer, error_of, error_response
from quart_transport.retry import replica_gone
from quart_transport.tracing import Trace, trace_of, with_trace
from quart_transport.upstream import Upstream, UpstreamError, UpstreamTimeout

from keysmanager.aio import within

_SLICE = 1 << 20


BodyReader = Callable[[Reservation], Awaitable[bytes]]  # the whole body, counted in the reservation as it arrives
R = TypeVar("R")


def refused(exc: QuartError, retry_after_s: int) -> web.Response:
    """A call refused before its body was read (413, 429, 400): answered, and the connection closed after the
    answer, so the gateway never reads (nor holds) the rest of a body it refused."""
    response = error_of(exc, retry_after_s)
    response.force_close()
    return response


async def continue_100(request: web.Request) -> None:
    """Let the client send its body: ``100 Continue`` for ``Expect: 100-continue`` on HTTP/1.1 (what aiohttp's
    default expect handler does); 417 for any other expectation."""
    expect = request.headers.get("Expect", "")
    if request.version != aiohttp.HttpVersion11:
        return
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim answer is not part of the response's size


class InvokeHandlers:
    """The invocation handlers over one gateway, with the HTTP client they call replicas through."""

    def __init__(self, gateway: EmbeddedGateway, provider: bool = False) -> None:
        self.gateway = gateway
        self.config = gateway.config
        self.upstream: Upstream | None = None
        self.ingest = RateMeter()  # request bodies' bytes per second as read here (admission by time)
        self.callback_policy = CallbackPolicy.from_text(self.config.callback_allowed_networks)
        self.async_calls = AsyncInvoker(self.config.async_workers, self.config.async_queue_cap,
                                        self.config.async_timeout_s, CallbackSender(
                                            self.callback_policy, self.config.callback_timeout_s,
                                            self.config.callback_per_destination))
        if not provider and self.config.async_backend == "memory":  # one registration per gateway
            gateway.metrics.registry.register(self.async_calls)

    async def startup(self) -> None:
        # keep-alive to the replicas; a replica on a host that went silent: 502 in ~2 s, not at upstream_timeout_s
        self.upstream = upstream_pool(self.config.upstream_timeout_s, keepalive_s=60)

    async def stop_async_calls(self) -> None:
        """In memory: let queued async calls run a little (they need the replicas), then answer the rest 503."""
        await self.async_calls.close(drain_s=min(5.0, self.config.drain_timeout_s))
        await self.async_calls.sender.close()

    async def close(self) -> None:
        if self.upstream is not None:
            await self.upstream.close()

    async def _invocation_body(self, request: web.Request) -> bytes:
        """The body of a /function or /async-function call; 413 over ``max_body_bytes``."""
        return await read_body(request, self.config.max_body_bytes)

    async def async_invoke(self, request: web.Request) -> web.Response:
        """``POST /async-function/{name}``: 202 + ``X-Call-Id`` now, the call later (see :mod:`.async_calls`)."""
        if request.method != "POST":
            return error_response(405, f"asynchronous invocation takes POST, not {request.method}", "method",
                                  headers={"Allow": "POST"})
        name = namespaces.function_name(request.match_info["name"], self.config.namespace)
        if name not in self.gateway.functions and name not in self.gateway.registry.pipelines():
            return error_response(404, f"function {name!r} not found", "functionName")
        try:
            callback = await self.callback_policy.check_url(request.headers.get(CALLBACK_HEADER))
        except ValueError as exc:
            return error_response(400, str(exc), CALLBACK_HEADER)
        queue = self.gateway.async_queue
        bodies = queue.bodies if self.config.async_backend == "nats" and queue is not None else None
        body, body_file = (await bodies.receive(request, self.config.max_body_bytes) if bodies is not None
                           else (await self._invocation_body(request), None))  # large bodies: a file, not memory
        tail = request.raw_path.split("/async-function/", 1)[1]  # path and query as sent
        trace = trace_of(request)
        headers = {k: v for k, v in forwardable(request.headers.items()).items() if k.lower() != CALLBACK_HEADER.lower()}
        trace.mark(headers)
        if self.config.async_backend == "nats":
            if queue is None:
                return error_response(503, f"asynchronous calls are unavailable: {self.gateway.async_unavailable}",
                                      None, headers={"Retry-After": str(self.config.retry_after_s)})
            await queue.publish(QueuedCall(trace.call_id, name, tail, headers, body, callback, time.time(), body_file))
            return web.Response(status=202)
        host, port = request.transport.get_extra_info("sockname")[:2]  # this listener: the worker calls back in
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{port}/function/{tail}"
        if not self.async_calls.submit(AsyncCall(trace.call_id, name, url, headers, body, callback)):
            if self.async_calls.closed:
                return error_response(503, "the gateway is stopping", None,
                                      headers={"Retry-After": str(self.config.retry_after_s)})
            return error_response(429, f"the async queue is full ({self.async_calls.capacity} calls wait); retry "
                                       "later", None, headers={"Retry-After": str(self.config.retry_after_s)})
        return web.Response(status=202)

    def pipeline(self, raw_name: str) -> str | None:
        """The pipeline ``raw_name`` names when a pipeline route is attached (else None); a
        :class:`QuartError` for a foreign namespace."""
        if self.gateway.pipeline_route is None:
            return None
        name = namespaces.function_name(raw_name, self.config.namespace)
        return name if name in self.gateway.registry.pipelines() and name not in self.gateway.functions else None

    def generates(self, model: str) -> bool:
        """Whether ``model``'s calls may be generation (a streamed answer: the aiohttp server takes them)."""
        route = self.gateway.generation_route
        return route is not None and route.generates(model)

    def function(self, raw_name: str) -> FunctionState | None:
        """The deployed function ``raw_name`` names (faas-cli's namespace suffix understood), None when it is
        not one (a pipeline, another hook's); a :class:`QuartError` for a foreign namespace."""
        return self.gateway.functions.get(namespaces.function_name(raw_name, self.config.namespace))

    async def invoke(self, request: web.Request) -> web.StreamResponse:
        """``/function/{name}[/{tail}]``: proxy to a replica of a deployed function, else ask the invoke hooks."""
        try:
            fn = self.function(request.match_info["name"])
        except QuartError as exc:
            return error_of(exc, self.config.retry_after_s)
        limit = self.config.max_body_bytes

        async def respond(answer: Answer) -> web.StreamResponse:
            return await _web_answer(request, answer)

        if fn is None:
            model = self.pipeline(request.match_info["name"])
            if model is not None:
                read: BodyReader = lambda r: read_body(request, limit, r)  # noqa: E731
                route = self.gateway.generation_route
                if request.method == "POST" and route is not None and route.generates(model):
                    try:
                        body = await read_body(request, limit)
                    except QuartError as exc:
                        return error_of(exc, self.config.retry_after_s)
                    streamed = await route.answer(request, model, body)
                    if streamed is not None:
                        return streamed
                    read = _given(body)  # a one-shot body: the pipeline route, as below
                return await self.call_pipeline(model, request.method, request.raw_path, request.headers,
                                                trace_of(request), read, respond)
            return await self._hooks(request, namespaces.function_name(request.match_info["name"],
                                                                       self.config.namespace),
                                     request.match_info.get("tail", ""))
        return await self.call(fn, request.method, request.raw_path, request.headers, request.host,
                               trace_of(request), lambda reservation: read_body(request, limit, reservation), respond)

    async def call(self, fn: FunctionState, method: str, raw_path: str, headers: Mapping[str, str], host: str,
                   trace: Trace, read: BodyReader, respond: Callable[[Answer], Awaitable[R]]) -> R:
        """One call of a deployed function, whatever HTTP server took it (aiohttp here, :mod:`.front`).

        Admission by time, then the body read whole under the byte gate (``read(reservation)``; a
        :class:`QuartError` from either: refused, the connection closed after the answer), the proxy, and
        ``respond(answer)`` with the tracing headers stamped, while the body's and answer's bytes are held."""
        reservation = Reservation(self.gateway.body_gate, fn.name)  # this body's bytes, held until the answer
        admitted: FunctionState | None = None
        try:
            try:
                deadline_s = client_deadline_s(headers, self.config.upstream_timeout_s)  # 400 when malformed
                deadline_at = None if deadline_s is None else time.monotonic() + deadline_s
                admission = self._admission(fn, headers, deadline_s)
                if not admission.admit:
                    raise admission.error()
                fn.admitted += 1
                admitted = fn
                started = time.monotonic()
                body = await read(reservation)
                self.ingest.record(len(body), time.monotonic() - started)
                if deadline_s is not None and deadline_at is not None:
                    self._still_fits(fn, deadline_at, deadline_s)
            except QuartError as exc:
                answer = answer_of(exc, self.config.retry_after_s, close=True)
            else:
                answer = await self._proxy(fn, method, raw_path, headers, host, trace, body, reservation,
                                           deadline_at)
            trace.finish(answer.headers)
            if len(answer.body) <= _SLICE:  # written in one piece: released first (a large one is held while sent)
                reservation.close()
            return await respond(answer)
        finally:
            if admitted is not None:
                admitted.admitted -= 1
            reservation.close()

    async def call_pipeline(self, model: str, method: str, raw_path: str, headers: Mapping[str, str], trace: Trace,
                            read: BodyReader, respond: Callable[[Answer], Awaitable[R]]) -> R:
        """One call of pipeline ``model``, whatever HTTP server took it: the body read whole under the byte
        gate (POST only; another method's body is left unread and the connection closed after the answer),
        then the pipeline route (the router: its own admission, queues, retries and deadline)."""
        route = self.gateway.pipeline_route
        assert route is not None
        reservation = Reservation(self.gateway.body_gate, model)  # this body's bytes, held until the answer
        try:
            try:
                body = await read(reservation) if method == "POST" else b""
            except QuartError as exc:
                answer = answer_of(exc, self.config.retry_after_s, close=True)
            else:
                tail = raw_path.split("/function/", 1)[1].split("?", 1)[0].partition("/")[2]
                answer = await route(model, method, tail, trace.mark(CIMultiDict(headers)), body)
                answer.close = answer.close or method != "POST"
            trace.finish(answer.headers)
            return await respond(answer)
        finally:
            reservation.close()

    def _admission(self, fn: FunctionState, headers: Mapping[str, str], deadline_s: float | None) -> Admission:
        """Admission by time of a call of ``fn`` (:func:`quart_kernel.admission.admit_by_time`): its body's transfer at the
        measured ingest rate, the queue, the p90 service time, × ``admission_safety``; only when the client
        sent a deadline (without one, the upstream timeout bounds the call and the queue cap its wait)."""
        if deadline_s is None:
            return Admission(True)
        try:
            length = int(headers.get("Content-Length", "") or 0)
        except ValueError:
            length = 0
        return admit_by_time([self._load(fn)], deadline_s, f"a call of {fn.name!r}",
                             transfer_s=self.ingest.seconds(length),
                             safety=self.config.admission_safety, floor_s=self.config.min_deadline_ms / 1000.0)

    def _still_fits(self, fn: FunctionState, deadline_at: float, deadline_s: float) -> None:
        """Once its body is in (an upload slower than measured), a call that can no longer finish in time is
        refused now (429), not answered 504 at its deadline."""
        load = self._load(fn)
        load = replace(load, queued=max(0, load.queued - 1))  # this call is admitted: not ahead of itself
        remaining = deadline_at - time.monotonic()
        late = admit_by_time([load], remaining, safety=self.config.admission_safety) if remaining > 0 \
            else Admission(False, 0.0, 1)
        if not late.admit:
            raise QuartError(429, f"the body of a call of {fn.name!r} took most of its {deadline_s:.2f} s deadline "
                                  f"to arrive; the rest (about {late.expected_wait_s:.2f} s) cannot fit; retry later",
                             None, {"Retry-After": str(max(1, late.retry_after_s))})

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue`` (curl sends it for bodies over 1 MB): refuse before the client sends the body
        when the call would be refused after it (time, bytes), else let it send (100 Continue)."""
        try:
            fn = self.function(request.match_info["name"])
        except QuartError as exc:
            return refused(exc, self.config.retry_after_s)
        if fn is not None:
            try:
                deadline_s = client_deadline_s(request.headers, self.config.upstream_timeout_s)
            except QuartError as exc:
                return refused(exc, self.config.retry_after_s)
            admission = self._admission(fn, request.headers, deadline_s)
            refusal = None if admission.admit else admission.error()
            if refusal is None and request.content_length:
                refusal = self.gateway.body_gate.refusal(fn.name, request.content_length)
            if refusal is not None:
                return refused(refusal, self.config.retry_after_s)
        return await continue_100(request)

    async def _hooks(self, request: web.Request, name: str, tail: str) -> web.StreamResponse:
        """A name that is neither a function nor a pipeline: another invoke hook's (the plugin's own paths)."""
        hooked = with_trace(request)
        for hook in self.gateway.invoke_hooks:
            response = await hook(hooked, name, tail)
            if response is not None:
                return response
        return error_response(404, f"function {name!r} not found", "functionName")

    @staticmethod
    def _load(fn: FunctionState) -> StageLoad:
        """The function's queue as admission sees it: calls admitted and not being served (reading their body,
        waiting for a replica) ahead of this one (unlimited concurrency: nobody ever queues)."""
        per_replica = fn.deployment.concurrency
        servers = len(fn.ready) * per_replica if per_replica else 0
        serving = sum(e.in_flight for e in fn.ready)
        return StageLoad(max(0, fn.admitted - serving), servers, fn.service.p90(), fn.service.fastest(),
                         busy=servers > 0 and serving >= servers)

    async def _proxy(self, fn: FunctionState, method: str, raw_path: str, in_headers: Mapping[str, str], host: str,
                     trace: Trace, body: bytes, reservation: Reservation, deadline_at: float | None) -> Answer:
        """Hand the call to a replica the balancer picks (one retry elsewhere when it refused the connection).

        With a client deadline (``X-Quart-Timeout-Ms``), waiting for a replica and the replica's answer are
        bounded by it (504 past it). The answer's bytes are counted in ``reservation`` too (never refused:
        the work is done), so that what the gateway holds bounds what it admits next."""
        gateway, name = self.gateway, fn.name
        metrics, metric_name = gateway.metrics, fn.metric_name
        metrics.invocation_started(metric_name)
        start = time.perf_counter()
        headers = trace.mark(forwardable(in_headers.items()))
        headers["X-Forwarded-Host"] = host
        path = _upstream_path(raw_path)
        payload, wait_s, left = None, 0.0, 0.0
        for attempt in range(2):  # a replica that refuses the connection never saw the request: try another
            try:  # a free ready replica without a wait (the common case), else wait (bounded) for one
                endpoint = gateway.balancer.acquire_nowait(fn)
                if endpoint is None:
                    if deadline_at is None:
                        endpoint = await gateway.balancer.acquire(fn)
                    else:  # no later than it can still be served in time (kernel/shedding.py)
                        left = deadline_at - time.monotonic()
                        wait_s = replica_wait_s(left, self._load(fn).service_s, self.config.admission_safety)
                        endpoint = await within(wait_s, gateway.balancer.acquire(fn))
            except ServiceUnavailable as exc:
                metrics.invocation_done(metric_name, exc.status, time.perf_counter() - start)
                return answer_of(exc, self.config.retry_after_s)
            except TimeoutError:
                if wait_s < left:  # cut short: shed while its deadline has not passed, not a 504 at it
                    metrics.invocation_done(metric_name, 429, time.perf_counter() - start)
                    return error_answer(429, f"the call of {name!r} can no longer be served within its deadline "
                                             "(X-Quart-Timeout-Ms): no replica was free in time; retry later", None,
                                        {"Retry-After": str(self.config.retry_after_s), SHED_HEADER: "deadline"})
                metrics.invocation_done(metric_name, 504, time.perf_counter() - start)
                return error_answer(504, f"the call of {name!r} passed its deadline (X-Quart-Timeout-Ms) waiting "
                                         "for a replica", "X-Quart-Timeout-Ms")
            try:
                timeout_s = self.config.upstream_timeout_s if deadline_at is None else min(
                    self.config.upstream_timeout_s, max(0.001, deadline_at - time.monotonic()))
                served_from = time.perf_counter()
                upstream = await self.upstream.request(method, endpoint.url, path, headers, body,
                                                       timeout_s=timeout_s)
                served_s = time.perf_counter() - served_from
                payload, status, out_headers = upstream.body, upstream.status, upstream.headers
                reservation.hold(len(payload))  # the answer counts in the byte bound too (never refused)
                break
            except UpstreamError as exc:
                if replica_gone(exc):  # never saw the request (quart_transport.retry): another one may take it
                    gateway.balancer.mark_unreachable(fn, endpoint)
                    status, message = 502, f"replica {endpoint.id} of {name!r} refused the connection: {exc}"
                    if attempt == 1:
                        break
                    continue  # the next acquire waits (bounded) for another ready replica
                status = 504 if isinstance(exc, UpstreamTimeout) else 502  # the deadline or upstream_timeout_s
                message = f"replica {endpoint.id} of {name!r} failed: {exc.__class__.__name__}: {exc}"
                break
            finally:
                gateway.balancer.release(fn, endpoint)
        fn.invocations += 1
        elapsed = time.perf_counter() - start
        if payload is not None and 200 <= status < 300:  # the service time admission by time uses
            fn.service.record(served_s)
        metrics.invocation_done(metric_name, status, elapsed)
        if payload is None:
            return error_answer(status, message)
        if "Content-Type" not in out_headers:  # what aiohttp's Response says of bytes with no type
            out_headers["Content-Type"] = "application/octet-stream"
        return Answer(status, out_headers, payload)


async def _web_answer(request: web.Request, answer: Answer) -> web.StreamResponse:
    """An :class:`Answer` as aiohttp's response; a large one in slices, each waiting for the client to drain
    (no second copy buffered)."""
    if len(answer.body) <= _SLICE:
        response = web.Response(status=answer.status, body=answer.body, headers=answer.headers)
        if answer.close:
            response.force_close()
        return response
    response = web.StreamResponse(status=answer.status, headers=answer.headers)
    response.content_length = len(answer.body)
    await response.prepare(request)
    view = memoryview(answer.body)
    for offset in range(0, len(view), _SLICE):
        await response.write(view[offset:offset + _SLICE])
    await response.write_eof()
    return response


def _upstream_path(raw_path: str) -> str:
    """The path and query a replica gets for ``/function/{name}[/{tail}][?query]``, as the client sent them."""
    rest = raw_path.split("/function/", 1)[1]
    slash, query = rest.find("/"), rest.find("?")
    if slash >= 0 and (query < 0 or slash < query):
        return rest[slash:]
    return "/" + rest[query:] if query >= 0 else "/"


def _given(body: bytes) -> BodyReader:
    """A reader of a body already read whole: its bytes counted in the reservation, then handed over."""

    async def read(reservation: Reservation) -> bytes:
        reservation.add(len(body))
        return body

    return read
