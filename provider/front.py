"""The fast front of ``/function/<name>``: an :class:`asyncio.Protocol` HTTP/1.1 server for invocations of
deployed functions and of pipelines, handing every other request, and its connection, to the aiohttp
application.

aiohttp's server costs ≈ 45 µs of CPU per request on the benchmark machine (request, response, writer
objects, a task per connection, middlewares and routing) before the proxy does anything; the proxy hop
itself is a few µs. This front parses what an invocation needs (request line, headers, a
``Content-Length`` or chunked body) from one buffer and calls the same
:meth:`.handlers_invoke.InvokeHandlers.call` as the aiohttp handler: one invoke semantics (admission by
time and bytes, 413/429 + Retry-After, tracing headers, retries, metrics), two HTTP servers; for a
pipeline it calls :meth:`.handlers_invoke.InvokeHandlers.call_pipeline` (the body read here, then the
gateway's pipeline route: the plugin's router), so a pipeline request is parsed once.

It takes ``METHOD /function/<name>[/<tail>][?query] HTTP/1.1`` for a *deployed function* or a *pipeline*
(not HEAD), with
at most one ``Content-Length`` (digits) or ``Transfer-Encoding: chunked`` alone, no ``Expect`` nor
``Upgrade``, and no bare CR/LF or NUL in its head. Anything else — ``/system/*``, ``/async-function``,
other invoke hooks' names, a name with ``%``, HTTP/1.0, a head over 8 KiB, a malformed
request — is handed over whole (nothing of it consumed) to aiohttp's request handler, which keeps the
connection from then on and answers as it always did (400 for what it finds malformed). Requests on a
connection are answered in order, one at a time (pipelining-safe); reading pauses while more than
64 KiB beyond the body being read waits in the buffer. A body is read whole (chunk extensions and
trailers checked and dropped; the chunk and field grammar of :mod:`quart_transport.http1`) and counted in the byte gate as it is announced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import web
from multidict import CIMultiDict
from quart_provider.bodies import too_large
from quart_provider.body_gate import Reservation
from quart_provider.handlers_invoke import InvokeHandlers
from quart_provider.types import FunctionState
from quart_stage.errors import QuartError
from quart_transport.http1 import chunk_size, field_line_ok
from quart_transport.responses import Answer, error_answer
from quart_transport.tracing import Trace

log = logging.getLogger("quart.front")

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 8190  # a longer head goes to aiohttp (its line and field limits decide)
_MAX_TRAILERS = 64 * 1024
_HIGH_WATER = 64 * 1024  # bytes buffered beyond the body being read before reading pauses
_JOIN_MAX = 64 * 1024  # answers up to this size go out in one write with their head
_SLICE = 1 << 20  # a larger answer: slices, each waiting for the client to drain
_MAX_CHUNK_LINE = 4096
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_NO_BODY = frozenset({204, 304})
_NAMES: set[str] = set()  # header names already seen to be tokens (bounded): no regex per header per request


@dataclass(slots=True)
class _Request:
    method: str
    target: str  # path and query as sent
    headers: CIMultiDict[str]
    fn: FunctionState | None  # None: a pipeline (``model``)
    length: int  # Content-Length (0 when none)
    chunked: bool
    close: bool  # Connection: close
    model: str = ""  # the pipeline, when ``fn`` is None


def _truncated() -> QuartError:
    return QuartError(400, "request body is truncated: the connection ended before it", "body")


class Front:
    """What the connections of one listener share: the invoke handlers, aiohttp's protocol factory (the
    fallback), the live connections (idle ones closed after ``keepalive_s``, all of them at :meth:`close`)."""

    def __init__(self, invoke: InvokeHandlers, fallback: web.Server, keepalive_s: float = 75.0) -> None:
        self.invoke = invoke
        self.fallback = fallback
        self.keepalive_s = keepalive_s
        self.limit = invoke.config.max_body_bytes
        self.connections: set[FrontConnection] = set()
        self.closing = False
        self._date: tuple[int, str] = (0, "")
        self._sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def __call__(self) -> FrontConnection:
        if self.loop is None:  # asyncio.get_running_loop() costs a getpid() system call: once per listener
            self.loop = asyncio.get_running_loop()
        if self._sweeper is None and not self.closing:
            self._sweeper = self.loop.call_later(self.keepalive_s / 4, self._sweep)
        return FrontConnection(self, self.loop)

    def date(self) -> str:
        """The ``Date`` header's value (computed once a second)."""
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True))
        return self._date[1]

    def _sweep(self) -> None:
        cutoff = time.monotonic() - self.keepalive_s
        for conn in list(self.connections):
            if not conn.busy and conn.idle_since < cutoff and conn.transport is not None:
                conn.transport.close()
        self._sweeper = None if self.closing else asyncio.get_running_loop().call_later(self.keepalive_s / 4,
                                                                                       self._sweep)

    async def close(self, timeout_s: float) -> None:
        """Close idle connections now, the others once their request is answered (``timeout_s`` at most)."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        deadline = time.monotonic() + timeout_s
        while True:
            for conn in list(self.connections):
                if not conn.busy and conn.transport is not None:
                    conn.transport.close()
            if not self.connections or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()


class FrontConnection(asyncio.Protocol):
    """One client connection while the front holds it."""

    def __init__(self, front: Front, loop: asyncio.AbstractEventLoop) -> None:
        self.front, self.loop = front, loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy = False  # a request is being served
        self.request: _Request | None = None
        self.eof = False
        self.paused = False  # reading
        self.want = 0  # bytes the body being read may buffer (beyond them: _HIGH_WATER)
        self.waiter: asyncio.Future[None] | None = None  # the body reader waits for ``want`` bytes
        self.drained: asyncio.Future[None] | None = None
        self.write_paused = False
        self.idle_since = time.monotonic()
        self.task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.front.connections.add(self)
        if self.front.closing:
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.connections.discard(self)
        self.transport = None
        self._wake(ConnectionResetError("the client closed the connection"))
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def eof_received(self) -> bool:
        self.eof = True
        self._wake(_truncated())
        return self.busy  # half-closed: answer the request in flight, then close

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next()
            return
        if self.waiter is not None and len(self.buffer) >= self.want and not self.waiter.done():
            self.waiter.set_result(None)
        if not self.paused and len(self.buffer) > self.want + _HIGH_WATER and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _wake(self, error: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    # ------------------------------------------------------------------ requests

    def _next(self) -> None:
        """Serve the next request in the buffer once its head is whole, or hand the connection over."""
        buffer = self.buffer
        while buffer.startswith(b"\r\n"):  # empty lines before a request line are ignored (RFC 9112 2.2)
            del buffer[:2]
        end = buffer.find(_HEAD_END)
        if end < 0 or end > _MAX_HEAD:
            if len(buffer) > _MAX_HEAD or b"\n\n" in buffer:  # over 8 KiB; a head ended by bare LFs
                self._hand_over()
            elif self.eof and self.transport is not None:
                self.transport.close()
            return
        request = self._parse(buffer[:end].decode("utf-8", "surrogateescape"))  # as aiohttp reads heads
        if request is None:
            self._hand_over()
            return
        del buffer[:end + 4]
        self.busy, self.request = True, request
        self.task = self.loop.create_task(self._serve(request))  # referenced while it runs

    def _parse(self, head: str) -> _Request | None:
        """The request if this front takes it, else None (aiohttp does)."""
        lines = head.split("\r\n")
        if (head.count("\n") != len(lines) - 1 or head.count("\r") != len(lines) - 1 or "\x00" in head
                or "\x0b" in head or "\x0c" in head):
            return None  # a bare CR or LF, a NUL, a vertical tab or form feed (in no field value)
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[2] != "HTTP/1.1" or not parts[1].startswith("/function/"):
            return None
        method, target = parts[0], parts[1]
        if method == "HEAD" or not _TOKEN.fullmatch(method) or not (target.isascii() and target.isprintable()):
            return None
        rest = target[10:]
        cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        name = rest[:cut]
        if not name or "%" in name:
            return None
        model = ""
        try:
            fn = self.front.invoke.function(name)
            if fn is None:
                model = self.front.invoke.pipeline(name) or ""
                if model and self.front.invoke.generates(model):
                    return None  # a decoder pipeline: its generation answers stream (the aiohttp server)
        except QuartError:
            return None
        if fn is None and not model:
            return None
        headers: CIMultiDict[str] = CIMultiDict()
        length, chunked, close = -1, False, False
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if key not in _NAMES:
                if not sep or not _TOKEN.fullmatch(key):
                    return None  # obs-fold, a space before the colon, no colon
                if len(_NAMES) < 1024:
                    _NAMES.add(key)
            value = value.strip(" \t")
            lower = key.lower()
            if lower == "content-length":
                if length >= 0 or not value.isdigit() or not value.isascii() or len(value) > 15:
                    return None
                length = int(value)
            elif lower == "transfer-encoding":
                if chunked or value.lower() != "chunked":
                    return None
                chunked = True
            elif lower == "connection":
                tokens = {t.strip() for t in value.lower().split(",")}
                if "upgrade" in tokens:
                    return None
                close = close or "close" in tokens
            elif lower in ("expect", "upgrade"):
                return None
            headers.add(key, value)
        if chunked and length >= 0:
            return None
        return _Request(method, target, headers, fn, max(length, 0), chunked, close, model)

    def _hand_over(self) -> None:
        """From this request on, the connection is aiohttp's (nothing of the request was consumed)."""
        transport = self.transport
        self.front.connections.discard(self)
        if transport is None:
            return
        self.transport = None
        protocol = self.front.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self.paused:
            transport.resume_reading()
        data, self.buffer = bytes(self.buffer), bytearray()
        if data:
            protocol.data_received(data)
        if self.eof:
            protocol.eof_received()

    async def _serve(self, request: _Request) -> None:
        try:
            headers = request.headers
            host = headers.get("Host") or self._sockname()
            if request.fn is None:
                await self.front.invoke.call_pipeline(request.model, request.method, request.target, headers,
                                                      Trace.begin(headers), self._read, self._respond)
            else:
                await self.front.invoke.call(request.fn, request.method, request.target, headers, host,
                                             Trace.begin(headers), self._read, self._respond)
        except ConnectionError:
            if self.transport is not None:
                self.transport.close()
            return
        except asyncio.CancelledError:
            if self.transport is not None:
                self.transport.close()
            raise
        except Exception:
            log.exception("invocation of %s failed", request.target)
            if self.transport is not None:
                await self._respond(error_answer(500, "internal error of the gateway", close=True))
            return
        finally:
            self.busy, self.request, self.want, self.task = False, None, 0, None
            self.idle_since = time.monotonic()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.paused:
            self.paused = False
            transport.resume_reading()
        self._next()  # a pipelined request already in the buffer

    def _sockname(self) -> str:
        name = self.transport.get_extra_info("sockname") if self.transport is not None else None
        return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else ""

    # ------------------------------------------------------------------ the body

    async def _fill(self, size: int) -> None:
        """Wait until the buffer holds ``size`` bytes (reading resumed meanwhile)."""
        while len(self.buffer) < size:
            if self.eof:
                raise _truncated()
            if self.transport is None:
                raise ConnectionResetError("the client closed the connection")
            self.want = size
            if self.paused:
                self.paused = False
                self.transport.resume_reading()
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def _read(self, reservation: Reservation) -> bytes | bytearray:
        """The request's whole body, counted in ``reservation`` as it is announced; 413 over the limit."""
        request = self.request
        assert request is not None
        if request.chunked:
            return await self._read_chunked(reservation)
        size, limit = request.length, self.front.limit
        if size > limit:
            raise too_large(limit, size)
        if not size:
            return b""
        reservation.add(size)
        await self._fill(size)
        self.want = 0
        if len(self.buffer) == size and size > _JOIN_MAX:
            body, self.buffer = self.buffer, bytearray()  # the buffer itself: no copy of a large body
            return body
        body = bytes(self.buffer[:size])
        del self.buffer[:size]
        return body

    async def _line(self) -> int:
        """The offset of the CRLF ending the line at the start of the buffer."""
        while (eol := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > _MAX_CHUNK_LINE:
                raise QuartError(400, "malformed chunked body: a chunk-size or trailer line is too long", "body")
            await self._fill(len(self.buffer) + 1)
        if eol > _MAX_CHUNK_LINE:
            raise QuartError(400, "malformed chunked body: a chunk-size or trailer line is too long", "body")
        return eol

    async def _read_chunked(self, reservation: Reservation) -> bytes:
        limit, size, pieces, buffer = self.front.limit, 0, [], self.buffer
        while True:
            eol = await self._line()
            buffer = self.buffer
            try:
                chunk = chunk_size(buffer[:eol])
            except ValueError:
                raise QuartError(400, f"malformed chunked body: chunk size line {bytes(buffer[:min(eol, 20)])!r}",
                                 "body") from None
            del buffer[:eol + 2]
            if chunk == 0:
                break
            size += chunk
            if size > limit:
                raise too_large(limit)
            reservation.add(chunk)
            await self._fill(chunk + 2)
            buffer = self.buffer
            if buffer[chunk:chunk + 2] != b"\r\n":
                raise QuartError(400, "malformed chunked body: a chunk is not followed by CRLF", "body")
            pieces.append(bytes(buffer[:chunk]))
            del buffer[:chunk + 2]
        trailers = 0
        while (eol := await self._line()) > 0:  # trailer fields, dropped, up to the empty line
            trailers += eol + 2
            if trailers > _MAX_TRAILERS:
                raise QuartError(400, "malformed chunked body: trailers over 64 KiB", "body")
            if not field_line_ok(bytes(self.buffer[:eol])):
                raise QuartError(400, "malformed chunked body: a trailer is not a header field", "body")
            del self.buffer[:eol + 2]
        del self.buffer[:2]
        self.want = 0
        return b"".join(pieces)

    # ------------------------------------------------------------------ the answer

    async def _respond(self, answer: Answer) -> None:
        transport = self.transport
        if transport is None:
            return
        request = self.request
        close = answer.close or self.front.closing or (request is not None and request.close)
        status, body = answer.status, answer.body
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in answer.headers.items()]
        if "Date" not in answer.headers:
            lines.append(f"Date: {self.front.date()}\r\n")
        if status in _NO_BODY or status < 200:
            body = b""
        else:
            lines.append(f"Content-Length: {len(body)}\r\n")
        if close:
            lines.append("Connection: close\r\n")
        lines.append("\r\n")
        text = "".join(lines)
        if text.count("\n") != len(lines) or text.count("\r") != len(lines):  # a line break inside a header
            await self._respond(error_answer(502, "the replica's answer has a header with a line break in it",
                                             close=close))
            return
        head = text.encode("utf-8", "surrogateescape")  # as aiohttp writes heads
        if len(body) <= _JOIN_MAX:
            transport.write(head + body if body else head)
        else:
            transport.write(head)
            view = memoryview(body)
            for offset in range(0, len(view), _SLICE):
                if self.transport is None:
                    return
                transport.write(view[offset:offset + _SLICE])
                await self._drain()
        if close:
            transport.close()

    async def _drain(self) -> None:
        if self.write_paused and self.transport is not None:
            self.drained = self.loop.create_future()
            try:
                await self.drained
            finally:
                self.drained = None


class FrontSite(web.BaseSite):
    """A TCP listener whose connections start with the :class:`Front` (aiohttp's own for what it hands over), on
    aiohttp's public site interface: registered with its runner (``runner.cleanup()`` stops it), its own listener;
    :meth:`stop` closes the listener and the front's connections (``drain_s`` at most for those answering)."""

    def __init__(self, runner: web.AppRunner, invoke: InvokeHandlers, host: str, port: int, drain_s: float = 60.0,
                 backlog: int = 128, reuse_address: bool | None = None) -> None:
        super().__init__(runner, backlog=backlog)
        server = runner.server
        assert server is not None
        self.front = Front(invoke, server)
        self.host, self.requested_port, self.backlog = host, port, backlog
        self.reuse_address, self.drain_s = reuse_address, drain_s
        self.listener: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port once started (the requested one before)."""
        sockets = self.listener.sockets if self.listener is not None else ()
        return sockets[0].getsockname()[1] if sockets else self.requested_port

    name = property(lambda self: f"http://{self.host}:{self.port}")

    async def start(self) -> None:
        await super().start()  # registers the site with its runner
        self.listener = await asyncio.get_running_loop().create_server(
            self.front, self.host, self.requested_port, backlog=self.backlog, reuse_address=self.reuse_address)

    async def stop(self) -> None:
        if self.listener is not None:
            self.listener.close()
        await super().stop()
        with contextlib.suppress(Exception):
            await self.front.close(self.drain_s)
