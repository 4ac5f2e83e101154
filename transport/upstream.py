"""The proxy's lean HTTP/1.1 client to replicas: pooled keep-alive connections, one write per request.

``/function/{name}`` spends most of its time in the HTTP client (profile in docs/benchmarks.md): a
general client builds request, timer, response and stream objects and awaits several times per call.
This one does what a proxy hop needs and no more: the request (head + whole body) goes out in one
write on an idle keep-alive connection to the replica, and an :class:`asyncio.Protocol` parses the
answer (``Content-Length``, chunked, or up to close; interim 1xx answers skipped; no body for HEAD,
204, 304) into an :class:`UpstreamResponse`, resolving one future.

Connections are :func:`~quart_transport.dead_peer.dead_peer_socket` sockets (a silent host: an error
in about 2 s) with ``TCP_NODELAY``. :class:`UpstreamRefused`: no connection could be made (the replica
never saw the request; the proxy retries elsewhere) — also a *fresh* connection reset or closed before
one byte of the answer: a replica killed a moment ago still had its listening socket, the kernel took
the connection into the backlog and reset it when the process went (what a refused connection is a
moment later); :class:`UpstreamError`: anything else (a kept-alive connection reset, timeout, malformed
answer; the proxy answers 502).

:meth:`UpstreamPool.stream` is the same call with the answer's body handed over piece by piece as it
arrives (:class:`UpstreamStream`: streamed generation, server-sent events), each gap bounded.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from multidict import CIMultiDict
from quart_transport.dead_peer import dead_peer_socket
from quart_transport.headers import HOP_BY_HOP
from quart_transport.http1 import TOKEN, content_length, dechunk, field_value, next_chunk

from keysmanager.aio import within

_HEAD_END = re.compile(rb"\n\r?\n")
_STATUS_LINE = re.compile(r"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: [\t \x21-\x7e\x80-\xff]*)?")
_MAX_HEAD = 64 * 1024
_NO_BODY_STATUS = frozenset({204, 304})
_JOIN_MAX = 16 * 1024  # bodies up to this size go out in one buffer with the head


class UpstreamError(Exception):
    """The replica's answer failed after the connection was made (reset, timeout, malformed)."""


class UpstreamRefused(UpstreamError):
    """No connection to the replica could be made: it never saw the request."""


class UpstreamTimeout(UpstreamError):
    """No whole answer within the request's timeout."""


@dataclass(slots=True)
class UpstreamResponse:
    """A replica's answer: status, its end-to-end headers (hop-by-hop ones dropped) and the whole body
    (the receive buffer itself when the answer filled it exactly: no copy of a large body)."""

    status: int
    headers: CIMultiDict[str]
    body: bytes | bytearray



Piece = bytes | BaseException | None  # a piece of a streamed body; None: its end; an error: how it failed


class UpstreamStream:
    """A replica's answer whose body arrives piece by piece (:meth:`UpstreamPool.stream`): ``status``,
    ``headers``, then ``async for piece in stream`` (each wait bounded by ``idle_s``: :class:`UpstreamTimeout`)
    or ``await stream.read()``. :meth:`close` (or ``async with``) when done: a body not read to its end
    closes the connection; one read to its end returns it to the pool."""

    def __init__(self, status: int, headers: CIMultiDict[str], next_piece: Callable[[], Awaitable[Piece]],
                 release: Callable[[bool], None], idle_s: float) -> None:
        self.status, self.headers, self.idle_s = status, headers, idle_s
        self._next_piece, self._release = next_piece, release
        self._open = True

    def __aiter__(self) -> UpstreamStream:
        return self

    async def __anext__(self) -> bytes:
        if not self._open:
            raise StopAsyncIteration
        try:
            item = await within(self.idle_s, self._next_piece())
        except TimeoutError:
            self.close()
            raise UpstreamTimeout(f"no piece of the answer within {self.idle_s:g} s") from None
        if item is None:
            self._end(True)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._end(False)
            raise item
        return item

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        return b"".join([piece async for piece in self])

    def _end(self, whole: bool) -> None:
        if self._open:
            self._open = False
            self._release(whole)

    def close(self) -> None:
        self._end(False)

    async def __aenter__(self) -> UpstreamStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Upstream(Protocol):
    """A client to replicas: :class:`UpstreamPool` (lean) or ``upstream_aiohttp.AiohttpUpstreamPool``
    (``QUART_HTTP_CODEC=aiohttp``); :func:`quart_transport.codec.upstream_pool` makes the configured one."""

    async def request(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                      timeout_s: float | None = None) -> UpstreamResponse: ...

    async def stream(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                     timeout_s: float | None = None, idle_s: float | None = None) -> UpstreamStream: ...

    async def close(self) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight (``waiter``)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[UpstreamResponse] | None = None
        self.head_only = False  # the request in flight is a HEAD
        self.reusable = True
        self.closed = False
        self.idle_since = 0.0
        self.fresh = True  # no answer received on this connection yet
        # the answer being parsed: (status, headers, framing, length) once its head is in
        self.status = 0
        self.headers: CIMultiDict[str] | None = None
        self.framing = ""  # "length" | "chunked" | "close" | "none"
        self.length = 0
        self.pieces: asyncio.Queue | None = None  # a streamed answer's body: bytes, then None (end) or an error

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()  # once: each call costs a getpid() system call

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if self.headers is not None and self.framing == "close":
                self._finish(bytes(self.buffer))  # the body ran up to the close
            else:
                error = UpstreamRefused if self.fresh and not self.buffer and self.headers is None else UpstreamError
                waiter.set_exception(error(f"the replica closed the connection: {exc or 'end of stream'}"))
        self.waiter = None
        if self.pieces is not None:  # a streamed body: the end if it ran up to the close, else an error
            if self.framing == "close":
                self._end_stream()
            else:
                self.pieces.put_nowait(UpstreamError(f"the replica closed the connection mid-answer: {exc or 'end'}"))
                self.pieces = None

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost finishes a close-delimited body

    def send(self, raw: list[bytes], head_only: bool, stream: bool = False) -> asyncio.Future[UpstreamResponse]:
        self.waiter = self.loop.create_future()
        self.head_only = head_only
        self.pieces = asyncio.Queue() if stream else None
        if len(raw) > 1 and len(raw[1]) > _JOIN_MAX:
            self.transport.writelines(raw)  # type: ignore[union-attr]  # a large body: no copy
        else:
            self.transport.write(b"".join(raw))  # type: ignore[union-attr]  # one buffer, one send
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.fresh = False
        if self.waiter is None and self.pieces is None:
            self._fail("the replica sent bytes nobody asked for")
            return
        try:
            self._parse()
        except ValueError as exc:
            self._fail(f"malformed answer from the replica: {exc}")

    def _parse(self) -> None:
        buffer = self.buffer
        while self.headers is None:
            blank = _HEAD_END.search(buffer)  # the empty line (CRLF, or LF alone, ends each line)
            if blank is None or blank.start() > _MAX_HEAD:
                if len(buffer) > _MAX_HEAD:
                    raise ValueError("response head over 64 KiB")
                return
            self._read_head(bytes(buffer[:blank.start()]).decode("latin-1"))
            del buffer[:blank.end()]
        if self.pieces is not None:
            self._stream()
            return
        if self.framing == "length":
            if len(buffer) < self.length:
                return
            if len(buffer) == self.length and self.length > _JOIN_MAX:
                body, self.buffer = buffer, bytearray()  # hand the buffer over
            else:
                body = bytes(buffer[:self.length])
                del buffer[:self.length]
        elif self.framing == "chunked":
            framed = dechunk(buffer, 0)
            if framed is None:
                return
            body, total = framed
            del buffer[:total]
        elif self.framing == "none":
            body = b""
        else:  # "close": up to the end of the stream
            return
        self._finish(body)

    def _read_head(self, head: str) -> None:
        lines = head.split("\n")
        match = _STATUS_LINE.fullmatch(lines[0].removesuffix("\r"))
        if match is None:
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        status = int(match.group(2))
        headers: CIMultiDict[str] = CIMultiDict()
        length, chunked, close = None, False, match.group(1) == "1.0"
        fields: list[list[str]] = []
        for line in lines[1:]:
            line = line.removesuffix("\r")
            if line[:1] in (" ", "\t"):  # obs-fold: the previous field's value goes on
                if not fields:
                    raise ValueError("a continuation line before any header")
                fields[-1][1] += " " + line.lstrip(" \t")
                continue
            name, sep, value = line.partition(":")
            if not sep or not TOKEN.fullmatch(name):
                raise ValueError(f"bad header line {line[:80]!r}")
            fields.append([name, value])
        for name, raw in fields:
            value = field_value(raw)
            if value is None:
                raise ValueError(f"bad value of header {name[:40]!r}")
            key = name.lower()
            if key == "content-length":
                length = content_length(value, length)
            elif key == "transfer-encoding":
                if chunked or value.lower() != "chunked":
                    raise ValueError(f"transfer-encoding {value[:40]!r}: chunked (once) is the only one read")
                chunked = True
            elif key == "connection":
                close = "close" in value.lower() or (close and "keep-alive" not in value.lower())
            if key not in HOP_BY_HOP:
                headers.add(name, value)
        if status < 100:
            raise ValueError(f"status {status} (100 to 999)")
        if 100 <= status < 200 and status != 101:
            return  # interim answer (100 Continue, 103 Early Hints): the real one follows
        self.status, self.headers = status, headers
        self.reusable = not close
        if self.head_only or status in _NO_BODY_STATUS:
            self.framing = "none"
        elif chunked:
            self.framing = "chunked"
        elif length is not None:
            self.framing, self.length = "length", length
        else:
            self.framing, self.reusable = "close", False

    def _stream(self) -> None:
        """A streamed answer: its head resolves the waiter, each piece of its body goes to ``pieces``."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(UpstreamResponse(self.status, self.headers or CIMultiDict(), b""))
        pieces, buffer = self.pieces, self.buffer
        assert pieces is not None
        if self.framing == "length":
            take = min(len(buffer), self.length)
            if take:
                pieces.put_nowait(bytes(buffer[:take]))
                del buffer[:take]
                self.length -= take
            if self.length == 0:
                self._end_stream()
        elif self.framing == "chunked":
            while (found := next_chunk(buffer, 0)) is not None:
                piece, end = found
                del buffer[:end]
                if piece is None:
                    self._end_stream()
                    return
                if piece:
                    pieces.put_nowait(piece)
        elif self.framing == "none":
            self._end_stream()
        elif buffer:  # "close": up to the end of the stream
            pieces.put_nowait(bytes(buffer))
            buffer.clear()

    def _end_stream(self) -> None:
        pieces, self.pieces = self.pieces, None
        self.headers, self.framing = None, ""
        if self.buffer:
            self.reusable = False  # bytes past the answer: not a connection to reuse
        if pieces is not None:
            pieces.put_nowait(None)

    def _finish(self, body: bytes | bytearray) -> None:
        waiter, self.waiter = self.waiter, None
        response = UpstreamResponse(self.status, self.headers or CIMultiDict(), body)
        self.headers, self.framing = None, ""
        if self.buffer and self.reusable:
            self.reusable = False  # bytes past the answer: not a connection to reuse
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _fail(self, message: str, error: type[UpstreamError] = UpstreamError) -> None:
        waiter, self.waiter = self.waiter, None
        self.reusable = False
        if waiter is not None and not waiter.done():
            waiter.set_exception(error(message))
        elif self.pieces is not None:  # mid-way through a streamed body
            self.pieces.put_nowait(error(message))
            self.pieces = None
        if self.transport is not None:
            self.transport.close()


class UpstreamPool:
    """Keep-alive connections per replica address; :meth:`request` sends one request and returns its answer."""

    def __init__(self, timeout_s: float, keepalive_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self.idle: dict[tuple[str, int], list[UpstreamConnection]] = {}
        self.busy: set[UpstreamConnection] = set()
        self._targets: dict[str, tuple[str, int, str]] = {}  # base url -> (host, port, Host header)

    def _target(self, base_url: str) -> tuple[str, int, str]:
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamRefused(f"unsupported replica url {base_url!r} (http://host:port only)")
            port = parts.port or 80
            target = self._targets[base_url] = (parts.hostname, port, parts.netloc)
        return target

    async def _connect(self, host: str, port: int) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            try:
                ip = ipaddress.ip_address(host)
                infos = [(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM, 0, "",
                          (host, port))]
            except ValueError:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            last: OSError | None = None
            for info in infos:
                sock = dead_peer_socket(info)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    await loop.sock_connect(sock, info[4])
                except OSError as exc:
                    sock.close()
                    last = exc
                    continue
                _, protocol = await loop.create_connection(UpstreamConnection, sock=sock)
                return protocol
            raise last or OSError(f"no address for {host}")
        except OSError as exc:
            raise UpstreamRefused(f"cannot connect to {host}:{port}: {exc}") from exc

    async def _send(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                    stream: bool) -> tuple[UpstreamConnection, tuple[str, int], asyncio.Future[UpstreamResponse]]:
        host, port, host_header = self._target(base_url)
        key = (host, port)
        conn = self._idle_connection(key)
        if conn is None:
            conn = await self._connect(host, port)
        lines = [f"{method} {path} HTTP/1.1\r\nHost: {host_header}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers.items()]
        if body or method not in ("GET", "HEAD"):
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")
        self.busy.add(conn)
        return conn, key, conn.send([head, body] if body else [head], method == "HEAD", stream)

    def _done(self, conn: UpstreamConnection, key: tuple[str, int]) -> None:
        """A call on ``conn`` is over: back to the idle pool if it can carry another, else closed."""
        self.busy.discard(conn)
        if conn.reusable and not conn.closed and conn.waiter is None and conn.pieces is None:
            conn.idle_since = time.monotonic()
            self.idle.setdefault(key, []).append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    async def request(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                      timeout_s: float | None = None) -> UpstreamResponse:
        """``method base_url+path`` with ``headers`` (end-to-end ones; Host and Content-Length are set here).

        ``timeout_s`` (default: the pool's) bounds the whole answer: :class:`UpstreamTimeout` past it."""
        conn, key, waiter = await self._send(method, base_url, path, headers, body, stream=False)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        timer = conn.loop.call_later(timeout, self._time_out, conn, timeout)
        try:
            return await waiter
        except asyncio.CancelledError:
            conn.reusable = False  # the client left mid-request: the answer would land on the next request
            raise
        finally:
            timer.cancel()
            self._done(conn, key)

    async def stream(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                     timeout_s: float | None = None, idle_s: float | None = None) -> UpstreamStream:
        """Like :meth:`request`, answered once the head is in (``timeout_s`` bounds the wait for it); the body
        comes from the :class:`UpstreamStream`, each piece within ``idle_s`` (default: ``timeout_s``)."""
        conn, key, waiter = await self._send(method, base_url, path, headers, body, stream=True)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        pieces = conn.pieces
        assert pieces is not None
        timer = conn.loop.call_later(timeout, self._time_out, conn, timeout)
        try:
            head = await waiter
        except BaseException:
            conn.reusable = False
            self._done(conn, key)
            raise
        finally:
            timer.cancel()

        def release(whole: bool) -> None:
            if not whole:
                conn.reusable = False
                conn.pieces = None
            self._done(conn, key)

        return UpstreamStream(head.status, head.headers, pieces.get, release, timeout if idle_s is None else idle_s)

    def _idle_connection(self, key: tuple[str, int]) -> UpstreamConnection | None:
        pool = self.idle.get(key)
        now = time.monotonic()
        while pool:
            conn = pool.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s and not conn.transport.is_closing():
                return conn
            conn.transport.close()
        return None

    @staticmethod
    def _time_out(conn: UpstreamConnection, timeout_s: float) -> None:
        conn._fail(f"no answer within {timeout_s:g} s", UpstreamTimeout)  # noqa: SLF001 - same module

    async def close(self) -> None:
        """Close every connection, idle or in flight."""
        for pool in self.idle.values():
            for conn in pool:
                conn.transport.close()
        self.idle.clear()
        for conn in list(self.busy):
            conn._fail("the gateway is stopping")  # noqa: SLF001 - same module
