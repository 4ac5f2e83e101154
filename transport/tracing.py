"""Tracing headers of invocations, as the OpenFaaS gateway sets them (``MakeCallIDMiddleware``).

``X-Call-Id``: the client's when it sends one, else a new UUID4; ``X-Start-Time``: when the gateway
took the request, in unix nanoseconds. Both go on the upstream request and on every answer of
``/function`` and ``/async-function`` (errors and the pipeline router's answers included), with
``X-Duration-Seconds``: the gateway's time from taking the request to answering it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass

from aiohttp import web

CALL_ID = "X-Call-Id"
START_TIME = "X-Start-Time"
DURATION = "X-Duration-Seconds"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Random:
    """``os.urandom`` bytes (as hex) drawn 4 KiB at a time: one system call per 256 call ids, not per call."""

    def __init__(self) -> None:
        self.hex, self.pos = "", 0

    def take32(self) -> str:
        if self.pos >= len(self.hex):
            self.hex, self.pos = os.urandom(4096).hex(), 0
        self.pos += 32
        return self.hex[self.pos - 32:self.pos]


_RANDOM = _Random()


def new_call_id() -> str:
    """A random UUID4 string, as ``str(uuid.uuid4())`` but without building a UUID object (per request)."""
    h = _RANDOM.take32()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:]}"


_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}


@dataclass(frozen=True, slots=True)
class Trace:
    call_id: str
    start_ns: int  # unix time
    started: float  # perf_counter, for the duration

    @classmethod
    def begin(cls, headers: Mapping[str, str]) -> Trace:
        return cls(headers.get(CALL_ID) or new_call_id(), time.time_ns(), time.perf_counter())

    def mark(self, headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
        """Put the call id and start time on ``headers`` (an upstream request's); returns them."""
        headers[CALL_ID] = self.call_id
        headers[START_TIME] = str(self.start_ns)
        return headers

    def finish(self, headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
        """Put the answer's tracing headers on ``headers``: call id, start time and the duration so far."""
        self.mark(headers)
        headers[DURATION] = f"{time.perf_counter() - self.started:.6f}"
        return headers

    def stamp(self, response: web.StreamResponse) -> web.StreamResponse:
        """The answer's tracing headers (before it is sent)."""
        if not response.prepared:
            self.finish(response.headers)
        return response


_KEY = web.RequestKey("quart.trace", Trace)


def trace_of(request: web.Request) -> Trace:
    """The trace :func:`traced` began for ``request`` (a new one if it has none)."""
    trace = request.get(_KEY)
    if trace is None:
        trace = request[_KEY] = Trace.begin(request.headers)
    return trace


def traced(handler: Handler) -> Handler:
    """``handler`` with a trace begun before it runs and stamped on its answer."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        trace = trace_of(request)
        return trace.stamp(await handler(request))

    return wrapped


def with_trace(request: web.Request) -> web.Request:
    """``request`` carrying its trace's headers, for a handler that reads them (the invoke hooks)."""
    return request.clone(headers=trace_of(request).mark(request.headers.copy()))
