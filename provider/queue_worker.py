"""The queue worker: takes async calls from JetStream, runs them, POSTs results to their callbacks.

As OpenFaaS's queue-worker does (nats-queue-worker; the JetStream edition's retry settings): one durable
pull consumer (``faas-workers``, explicit acks) shared by every worker; a call is invoked through the
gateway's own ``/function/<path>`` (so a model goes through the pipeline router, a function through
the proxy), with ``User-Agent: quart-queue-worker``; its result goes to ``X-Callback-Url`` with the
function's answer headers plus ``X-Call-Id``, ``X-Function-Name``, ``X-Function-Status`` and
``X-Duration-Seconds``. An answer in ``async_retry_codes`` (408, 429, 500, 502, 503, 504 by default; an
invocation that fails outright counts as 503) is retried later with exponential back-off
(``async_initial_retry_s`` doubling up to ``async_max_retry_wait_s``) until ``async_max_attempts``
attempts, then the last answer is the one called back.

Once and only once: the message is acked only after its callback was answered (or there was none), and
the stream sequence of every delivered result is kept in a JetStream KV bucket, so a call redelivered
(the gateway stopped or died before the ack) is acked without being called back again. A long call
keeps its message with in-progress heartbeats. A graceful stop takes no new calls, lets running ones
finish within ``drain_s``, and naks the rest: they stay in the stream for the next start.

Runs in the gateway process (one JetStream consumer; a second gateway or a separate worker process
could pull from the same durable consumer without change).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator

import aiohttp
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from quart_provider.async_queue import STREAM, SUBJECT, AsyncQueue, QueuedCall
from quart_provider.callbacks import CallbackSender
from quart_transport.headers import forwardable

log = logging.getLogger("quart.gateway.queue")

DURABLE = "faas-workers"
JSON = {"Content-Type": "application/json"}


def backoff_s(attempt: int, initial_s: float, max_s: float) -> float:
    """Wait before attempt ``attempt + 1``: ``initial_s`` doubling per attempt, at most ``max_s``."""
    return min(max_s, initial_s * 2 ** max(0, attempt - 1))


def parse_codes(text: str) -> frozenset[int]:
    """``"429,502"`` → {429, 502}; ValueError names the entry that is not a status code."""
    codes = set()
    for item in (p.strip() for p in text.split(",")):
        if item:
            if not item.isdigit() or not 100 <= int(item) <= 599:
                raise ValueError(f"async_retry_codes: {item!r} is not an HTTP status code")
            codes.add(int(item))
    return frozenset(codes)


class QueueWorker:
    """Pulls from the durable consumer with ``workers`` calls running at once; results to callbacks."""

    def __init__(self, queue: AsyncQueue, gateway_url: str, sender: CallbackSender, *, workers: int,
                 timeout_s: float, ack_wait_s: float, max_attempts: int, initial_retry_s: float,
                 max_retry_wait_s: float, retry_codes: frozenset[int], backlog: int = 1024) -> None:
        self.queue, self.gateway_url, self.sender = queue, gateway_url.rstrip("/"), sender
        self.workers, self.timeout_s, self.ack_wait_s = max(1, workers), timeout_s, ack_wait_s
        self.max_attempts, self.retry_codes = max(1, max_attempts), retry_codes
        self.initial_retry_s, self.max_retry_wait_s = initial_retry_s, max_retry_wait_s
        self.backlog = backlog  # calls waiting for their callback, beyond the running ones
        self._slots = asyncio.Semaphore(self.workers)
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False
        self._queued = 0
        self.completed = self.failed = self.retried = self.duplicates = 0

    async def start(self) -> None:
        config = ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s,
                                max_deliver=-1, max_ack_pending=self.workers + self.backlog,
                                deliver_policy=DeliverPolicy.ALL)
        self._sub = await self.queue.js.pull_subscribe(SUBJECT, durable=DURABLE, stream=STREAM, config=config)
        self._session = aiohttp.ClientSession(auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                              skip_auto_headers=("User-Agent",))
        self._loop_task = asyncio.create_task(self._pull(), name="queue-worker")

    async def _pull(self) -> None:
        refreshed = 0.0
        while not self._stopping:
            if time.monotonic() - refreshed > 1.0:
                self._queued, refreshed = await self.queue.queued(), time.monotonic()
            await self._slots.acquire()
            try:
                msgs = await self._sub.fetch(1, timeout=0.5)
            except (nats.errors.TimeoutError, nats.js.errors.FetchTimeoutError, TimeoutError):
                self._slots.release()
                continue
            except Exception as exc:  # noqa: BLE001 - NATS reconnecting: wait and pull again
                self._slots.release()
                if not self._stopping:
                    log.warning("pulling async calls failed: %s: %s", type(exc).__name__, exc)
                    await asyncio.sleep(0.5)
                continue
            if self._stopping:  # fetched as the stop began: leave it for the next start
                for msg in msgs:
                    with contextlib.suppress(Exception):
                        await msg.nak()
                self._slots.release()
                break
            task = asyncio.create_task(self._handle(msgs[0]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, msg) -> None:
        slot = True
        try:
            try:
                call = QueuedCall.from_message(msg.headers, msg.data)
            except ValueError as exc:
                log.warning("dropping message %s of %s: %s", msg.metadata.sequence.stream, STREAM, exc)
                await msg.term()
                return
            key = f"seq-{msg.metadata.sequence.stream}"
            if await self._was_delivered(key):
                self.duplicates += 1
                await msg.ack()
                self._forget(call)
                return
            attempt = msg.metadata.num_delivered
            heartbeat = asyncio.create_task(self._heartbeat(msg))
            try:
                status, headers, body, seconds = await self._invoke(call)
                if status in self.retry_codes and (attempt < self.max_attempts or self._stopping):
                    self.retried += 1
                    delay = backoff_s(attempt, self.initial_retry_s, self.max_retry_wait_s)
                    log.info("async call %s to %s answered %d: attempt %d of %d, next in %.1f s", call.call_id,
                             call.function, status, attempt, self.max_attempts, delay)
                    await msg.nak(delay=delay)
                    return
                if 200 <= status < 300:
                    self.completed += 1
                else:
                    self.failed += 1
                self._slots.release()  # the callback waits on its destination, not on a worker slot
                slot = False
                if call.callback:
                    out = {**headers, "X-Call-Id": call.call_id, "X-Function-Name": call.function,
                           "X-Function-Status": str(status), "X-Duration-Seconds": f"{seconds:.6f}"}
                    if await self.sender.post(call.callback, out, body) is not None:
                        await self._mark_delivered(key)
                await msg.ack()
                self._forget(call)
            finally:
                heartbeat.cancel()
        except asyncio.CancelledError:  # the stop's drain ran out: the call stays in the stream
            with contextlib.suppress(Exception):
                await asyncio.shield(msg.nak())
            raise
        except Exception as exc:  # noqa: BLE001 - a worker survives anything; the message comes back
            log.warning("async call failed in the worker: %s: %s", type(exc).__name__, exc)
        finally:
            if slot:
                self._slots.release()

    async def _heartbeat(self, msg) -> None:
        with contextlib.suppress(Exception):
            while True:
                await asyncio.sleep(max(0.5, self.ack_wait_s / 3))
                await msg.in_progress()

    async def _invoke(self, call: QueuedCall) -> tuple[int, dict[str, str], bytes, float]:
        assert self._session is not None
        started = time.monotonic()
        headers = {**call.headers, "User-Agent": "quart-queue-worker"}
        try:
            with contextlib.ExitStack() as files:
                data = call.body  # a large body streams from its file (quart_provider.async_bodies)
                if call.body_file and self.queue.bodies is not None:
                    data = files.enter_context(open(self.queue.bodies.path(call.body_file), "rb"))  # noqa: SIM115
                async with self._session.post(f"{self.gateway_url}/function/{call.path}", data=data,
                                              headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as res:
                    body = await res.read()
                    return res.status, forwardable(res.headers.items()), body, time.monotonic() - started
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            body = json.dumps({"error": f"invoking {call.function} failed: {type(exc).__name__}: {exc}"}).encode()
            return 503, dict(JSON), body, time.monotonic() - started

    def _forget(self, call: QueuedCall) -> None:
        """The call is acked: its body file (if any) is no longer needed."""
        if call.body_file and self.queue.bodies is not None:
            with contextlib.suppress(OSError, ValueError):
                self.queue.bodies.remove(call.body_file)

    async def _was_delivered(self, key: str) -> bool:
        try:
            await self.queue.delivered.get(key)
        except nats.js.errors.KeyNotFoundError:
            return False
        return True

    async def _mark_delivered(self, key: str) -> None:
        try:
            await self.queue.delivered.put(key, b"1")
        except Exception as exc:  # noqa: BLE001 - a redelivery would then call back again: say so
            log.warning("could not record delivery %s: %s", key, exc)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client collector: queue length and outcomes (``registry.register(worker)``)."""
        queued = GaugeMetricFamily("quart_async_queue_length", "Asynchronous calls stored and not yet done")
        queued.add_metric([], self._queued)
        calls = CounterMetricFamily("quart_async_calls", "Asynchronous calls by outcome (accepted; completed: a "
                                    "2xx answer; failed: any other, after retries; retried: attempts retried)",
                                    labels=["outcome"])
        for outcome, value in (("accepted", self.queue.accepted), ("completed", self.completed),
                               ("failed", self.failed), ("retried", self.retried)):
            calls.add_metric([outcome], value)
        callbacks = CounterMetricFamily("quart_async_callbacks_failed", "Callbacks that could not be delivered")
        callbacks.add_metric([], self.sender.failed)
        yield from (queued, calls, callbacks)

    async def stop(self, drain_s: float) -> None:
        """Take no new calls; running ones get ``drain_s``; the rest are nak'd and stay in the stream."""
        self._stopping = True
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()
