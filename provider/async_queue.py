"""Durable async calls on NATS JetStream, as OpenFaaS queues them: the stream and what a call carries.

``POST /async-function/{name}`` publishes one message to the stream ``faas-request`` (subject
``faas-request``, file storage, work-queue retention: a message leaves the stream when a worker acks it)
and answers 202 once JetStream has stored it. The message's payload is the request body; its headers
carry the rest (:class:`QueuedCall`): the function as named in the path, the path and query to invoke,
the call id, the callback URL, the end-to-end request headers (JSON) and when it was accepted.
At most ``async_queue_cap`` calls wait (the stream discards new ones past that: 429); a body over the
server's ``max_payload`` is a 413; a body over 1 MiB waits in a file beside the stream (:mod:`.async_bodies`). The consumer side is :mod:`.queue_worker`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import nats
import nats.errors
import nats.js.errors
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from quart_provider.async_bodies import BodyStore
from quart_stage.errors import QuartError

log = logging.getLogger("quart.gateway.async")

STREAM = SUBJECT = "faas-request"  # OpenFaaS's channel name
DELIVERED_BUCKET = "faas-callbacks"  # stream sequences whose result was delivered: a redelivery is not re-sent
DELIVERED_TTL_S = 7 * 24 * 3600.0
H_FUNCTION, H_PATH, H_CALL_ID = "Quart-Function", "Quart-Path", "Quart-Call-Id"
H_CALLBACK, H_HEADERS, H_ACCEPTED = "Quart-Callback", "Quart-Headers", "Quart-Accepted-At"
H_BODY_FILE = "Quart-Body-File"  # the body is in the BodyStore under this name (quart_provider.async_bodies)


@dataclass(frozen=True, slots=True)
class QueuedCall:
    """One accepted async call, as stored in the stream."""

    call_id: str
    function: str  # as given in the path (``name`` or ``name.namespace``)
    path: str  # what follows /function/: ``name[/sub/path][?query]``, as sent
    headers: dict[str, str]  # end-to-end request headers, tracing headers included
    body: bytes
    callback: str | None
    accepted_at: float  # unix seconds
    body_file: str | None = None  # a large body, kept beside the stream (async_bodies.BodyStore)

    def to_message(self) -> tuple[dict[str, str], bytes]:
        headers = {H_FUNCTION: self.function, H_PATH: self.path, H_CALL_ID: self.call_id,
                   H_HEADERS: json.dumps(self.headers), H_ACCEPTED: f"{self.accepted_at:.6f}"}
        if self.callback:
            headers[H_CALLBACK] = self.callback
        if self.body_file:
            headers[H_BODY_FILE] = self.body_file
        return headers, self.body

    @classmethod
    def from_message(cls, headers: dict[str, str] | None, body: bytes) -> QueuedCall:
        """ValueError when the message is not one of ours (a worker terminates it)."""
        h = headers or {}
        try:
            return cls(h[H_CALL_ID], h[H_FUNCTION], h[H_PATH], json.loads(h.get(H_HEADERS, "{}")), body,
                       h.get(H_CALLBACK) or None, float(h.get(H_ACCEPTED, "0")), h.get(H_BODY_FILE) or None)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"not a queued call: {exc}") from None


class AsyncQueue:
    """The JetStream connection: the stream, the delivered-results bucket, publishing, the queue length."""

    def __init__(self, url: str, token: str, capacity: int, bodies: BodyStore | None = None) -> None:
        self.url, self._token, self.capacity = url, token, capacity
        self.bodies = bodies  # where large bodies wait (None: every body rides in its message)
        self.nc: nats.NATS | None = None
        self.js = None
        self.delivered = None  # KeyValue
        self.accepted = 0

    async def connect(self) -> None:
        self.nc = await nats.connect(self.url, token=self._token, connect_timeout=5, reconnect_time_wait=0.5,
                                     max_reconnect_attempts=-1, name="quart-gateway")
        self.js = self.nc.jetstream()
        config = StreamConfig(name=STREAM, subjects=[SUBJECT], retention=RetentionPolicy.WORK_QUEUE,
                              storage=StorageType.FILE, max_msgs=self.capacity, discard=DiscardPolicy.NEW,
                              max_msg_size=self.nc.max_payload)
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:  # it exists with other limits (another capacity): take ours
            await self.js.update_stream(config)
        self.delivered = await self.js.create_key_value(KeyValueConfig(
            bucket=DELIVERED_BUCKET, history=1, ttl=DELIVERED_TTL_S, storage=StorageType.FILE))

    async def publish(self, call: QueuedCall) -> int:
        """Store a call; its stream sequence. QuartError 413 (too big), 429 (full), 503 (NATS down)."""
        if self.js is None or self.nc is None or self.nc.is_closed:
            raise QuartError(503, "the async queue is not connected")
        try:
            return await self._publish(call)
        except BaseException:
            if self.bodies is not None:
                self.bodies.remove(call.body_file)
            raise

    async def _publish(self, call: QueuedCall) -> int:
        headers, body = call.to_message()
        if len(body) + 4096 > self.nc.max_payload:
            raise QuartError(413, f"an async call's body may be at most {self.nc.max_payload - 4096} bytes "
                             f"(NATS max_payload), got {len(body)}", "body")
        try:
            ack = await self.js.publish(SUBJECT, body, headers=headers, timeout=5)
        except nats.js.errors.APIError as exc:
            if "too large" in (exc.description or ""):  # JetStream's file store takes about 32 MiB at most
                raise QuartError(413, f"an async call's body of {len(body)} bytes is over what the queue stores "
                                 "in a message; send it with Content-Length (bodies over 1 MiB are kept beside "
                                 "the queue)", "body") from None
            if "maximum messages" in (exc.description or "") or exc.err_code in (10077, 10047):
                raise QuartError(429, f"the async queue is full ({self.capacity} calls wait); retry later"
                                 ) from None
            raise QuartError(503, f"the async queue refused the call: {exc.description}") from None
        except (nats.errors.Error, TimeoutError) as exc:
            raise QuartError(503, f"the async queue is unavailable: {type(exc).__name__}") from None
        self.accepted += 1
        return ack.seq

    async def queued(self) -> int:
        """Calls stored and not yet acked (0 when NATS does not answer)."""
        try:
            info = await self.js.stream_info(STREAM)
            return int(info.state.messages)
        except Exception:  # noqa: BLE001 - a gauge, not a decision
            return 0

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # noqa: BLE001 - closing anyway
                await self.nc.close()
        self.nc = None
