"""Asynchronous invocation in memory (``async_backend=memory``): not durable, for when NATS is not wanted.

The default backend is durable (:mod:`.async_queue`, :mod:`.queue_worker`); this one keeps the calls in
the gateway's memory and answers what is still queued at a stop with a 503 callback.

OpenFaaS answers an async call ``202 Accepted`` with an ``X-Call-Id``, queues the request (NATS) and a
queue-worker invokes the function later, POSTing the result to the caller's ``X-Callback-Url`` if one was
given, with the function's response headers plus ``X-Call-Id``, ``X-Function-Name``, ``X-Function-Status``
and ``X-Duration-Seconds``. Here the queue is a bounded in-memory queue (full → 429 + Retry-After) and the
workers invoke through the gateway's own ``/function/{name}`` over loopback, so a call takes exactly the
synchronous path: a pipeline model goes through the QUART router, a plain function through the proxy.

Not durable: calls still queued when the gateway stops get their callback with status 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from quart_provider.callbacks import CallbackSender
from quart_transport.headers import forwardable

from keysmanager.aio import within

log = logging.getLogger("quart.gateway.async")

JSON = {"Content-Type": "application/json"}
STOPPED_BEFORE_RUN = b'{"error": "the gateway stopped before the call ran"}'
STOPPED_DURING_RUN = b'{"error": "the gateway stopped while the call ran"}'


@dataclass(slots=True)
class AsyncCall:
    """One accepted call, as it waits in the queue."""

    call_id: str
    function: str  # as given in the path (``name`` or ``name.namespace``)
    url: str  # the gateway's own /function/... URL, query included
    headers: dict[str, str]
    body: bytes
    callback: str | None
    accepted_at: float = field(default_factory=time.monotonic)


class AsyncInvoker:
    """A bounded queue of async calls and the workers that run them."""

    def __init__(self, workers: int, capacity: int, timeout_s: float, sender: CallbackSender) -> None:
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.sender = sender
        self._queue: asyncio.Queue[AsyncCall] = asyncio.Queue(maxsize=capacity)
        self._workers_wanted = max(1, workers)
        self._workers: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self.accepted = self.completed = self.failed = self.callbacks_failed = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, call: AsyncCall) -> bool:
        """Queue a call; False when the queue is full or closing (the caller answers 429 / 503)."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait(call)
        except asyncio.QueueFull:
            return False
        self.accepted += 1
        if not self._workers:
            self._session = aiohttp.ClientSession(auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
            self._workers = [asyncio.create_task(self._work(), name=f"async-worker-{i}")
                             for i in range(self._workers_wanted)]
        return True

    async def _work(self) -> None:
        while True:
            call = await self._queue.get()
            try:
                if self._closed:  # the gateway stops: do not start what would race its listener closing
                    await self._callback(call, 503, JSON, STOPPED_BEFORE_RUN, time.monotonic() - call.accepted_at)
                else:
                    await self._run(call)
            except asyncio.CancelledError:
                await self._callback(call, 503, JSON, STOPPED_DURING_RUN, time.monotonic() - call.accepted_at)
                raise
            except Exception as exc:  # a worker must survive anything: log it and take the next call
                log.warning("async call %s to %s failed: %s", call.call_id, call.function, exc)
            finally:
                self._queue.task_done()

    async def _run(self, call: AsyncCall) -> None:
        assert self._session is not None
        started = time.monotonic()
        try:
            async with self._session.post(call.url, data=call.body, headers=call.headers,
                                          timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as res:
                body = await res.read()
                status = res.status
                headers = forwardable(res.headers.items())
        except (aiohttp.ClientError, TimeoutError) as exc:
            if self._closed:
                status, headers, body = 503, JSON, STOPPED_DURING_RUN
            else:
                status, headers = 502, JSON
                body = json.dumps({"error": f"invoking {call.function} failed: {type(exc).__name__}: {exc}"}).encode()
        if 200 <= status < 300:
            self.completed += 1
        else:
            self.failed += 1
        await self._callback(call, status, headers, body, time.monotonic() - started)

    async def _callback(self, call: AsyncCall, status: int, headers: dict[str, str], body: bytes,
                        seconds: float) -> None:
        if call.callback is None:
            return
        out = {**headers, "X-Call-Id": call.call_id, "X-Function-Name": call.function,
               "X-Function-Status": str(status), "X-Duration-Seconds": f"{seconds:.6f}"}
        if await self.sender.post(call.callback, out, body) is None:
            self.callbacks_failed += 1

    def collect(self) -> Iterator[Metric]:
        """prometheus_client custom collector: queue length and call outcomes (``registry.register(invoker)``)."""
        queued = GaugeMetricFamily("quart_async_queue_length", "Asynchronous calls accepted and waiting to run")
        queued.add_metric([], self.queued)
        calls = CounterMetricFamily("quart_async_calls", "Asynchronous calls by outcome (accepted, completed: a 2xx "
                                    "answer, failed: any other)", labels=["outcome"])
        for outcome, value in (("accepted", self.accepted), ("completed", self.completed), ("failed", self.failed)):
            calls.add_metric([outcome], value)
        callbacks = CounterMetricFamily("quart_async_callbacks_failed", "Callbacks that could not be delivered")
        callbacks.add_metric([], self.callbacks_failed)
        yield from (queued, calls, callbacks)

    async def close(self, drain_s: float = 5.0) -> None:
        """Stop accepting; calls running get ``drain_s`` to finish; queued ones get a 503 callback, not a run
        (the gateway's listener is closing)."""
        self._closed = True
        if self._workers:
            with contextlib.suppress(TimeoutError):
                await within(drain_s, self._queue.join())
            for task in self._workers:
                task.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)
            self._workers = []
        while not self._queue.empty():
            call = self._queue.get_nowait()
            await self._callback(call, 503, JSON, STOPPED_BEFORE_RUN, time.monotonic() - call.accepted_at)
        if self._session is not None:
            await self._session.close()
            self._session = None
