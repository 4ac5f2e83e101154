"""HTTP/1.1 messages for the codec conformance suite (tests/unit/test_http1_conformance.py), the drivers that feed
them to our two hand-written codecs in process (no socket), and h11's reading of the same bytes (the oracle).

- :func:`front_reads`: the ``/function`` front (``quart_provider.front``) as a server: which requests it
  serves (method, target, headers, body), and where it stops: hands the connection to aiohttp (``handover``,
  with the bytes handed over) or answers an error (``refused``, its status);
- :func:`oracle_requests`: h11 as a server on the same bytes: the whole requests, then ``refused`` or not;
- :func:`client_reads` / :func:`oracle_response`: the lean client to replicas (``quart_transport.upstream``)
  and h11 as a client, reading one answer to one request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import h11
from quart_provider.front import Front
from quart_stage.errors import QuartError
from quart_transport.headers import HOP_BY_HOP
from quart_transport.responses import Answer, answer_of
from quart_transport.upstream import UpstreamConnection, UpstreamError

LIMIT = 1 << 20
Request = tuple[str, str, list[tuple[str, str]], bytes]  # method, target, headers as sent, body


class FakeTransport(asyncio.Transport):
    """What a protocol writes, and whether it closed or handed the connection to another protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False
        self.protocol: asyncio.BaseProtocol | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def writelines(self, lines) -> None:
        for line in lines:
            self.out += line

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


class HandedOver(asyncio.Protocol):
    """Stands for aiohttp's protocol: records the bytes handed over with the connection."""

    def __init__(self) -> None:
        self.data = bytearray()

    def data_received(self, data: bytes) -> None:
        self.data += data


class Reservation:
    def add(self, size: int) -> None:
        pass


class EchoInvoke:
    """Stands for the invoke handlers: function ``f`` exists; each call reads the body whole and records it."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(max_body_bytes=LIMIT)
        self.served: list[Request] = []
        self.refused: list[int] = []

    def function(self, name: str) -> object | None:
        return SimpleNamespace(name=name) if name == "f" else None

    def pipeline(self, name: str) -> str | None:
        return None

    def generates(self, model: str) -> bool:
        return False

    async def call(self, fn, method, target, headers, host, trace, read, respond) -> None:
        try:
            body = await read(Reservation())
        except QuartError as exc:
            self.refused.append(exc.status)
            await respond(answer_of(exc, 1, close=True))
            return
        self.served.append((method, target, list(headers.items()), bytes(body)))
        await respond(Answer(200, {"X-Served": str(len(self.served))}, b"ok"))


@dataclass
class Outcome:
    """How a codec (or the oracle) read a stream of requests."""

    requests: list[Request] = field(default_factory=list)
    handover: bytes | None = None  # the front handed the connection over, with these bytes
    refused: int | None = None  # an error answer's status (the front) / 400 (h11 refused)
    out: bytes = b""  # what the front wrote


async def _settle() -> None:
    for _ in range(8):
        await asyncio.sleep(0)


async def _front_reads(pieces: list[bytes]) -> Outcome:
    invoke = EchoInvoke()
    handed: list[HandedOver] = []

    def fallback() -> HandedOver:
        handed.append(HandedOver())
        return handed[-1]

    front = Front(invoke, fallback)  # type: ignore[arg-type]
    conn = front()
    transport = FakeTransport()
    conn.connection_made(transport)
    for piece in pieces:
        if transport.protocol is not None:
            transport.protocol.data_received(piece)
        elif not transport.closing:
            conn.data_received(piece)
        await _settle()
    await _settle()
    if conn.task is not None:
        conn.task.cancel()
    await front.close(0)
    return Outcome(invoke.served, bytes(handed[0].data) if handed else None,
                   invoke.refused[0] if invoke.refused else None, bytes(transport.out))


def front_reads(pieces: list[bytes]) -> Outcome:
    return asyncio.run(_front_reads(pieces))


def _text(value: bytes) -> str:
    """Bytes of an answer's head as the client decodes them (latin-1)."""
    return value.decode("latin-1")


def _request_text(value: bytes) -> str:
    """Bytes of a request's head as the front decodes them, aiohttp's way (UTF-8, undecodable bytes kept as
    surrogates): the parse is compared, not the decoding convention."""
    return value.decode("utf-8", "surrogateescape")


def oracle_requests(stream: bytes) -> Outcome:
    """h11 as a server: each whole request (answered 200 so that the next one is read), then refused or not."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    conn.receive_data(stream)
    outcome, current, body = Outcome(), None, bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            outcome.refused = 400
            return outcome
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return outcome
        if isinstance(event, h11.Request):
            current, body = event, bytearray()
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert current is not None
            headers = [(_request_text(k), _request_text(v)) for k, v in current.headers.raw_items()]
            outcome.requests.append((_request_text(current.method), _request_text(current.target), headers,
                                     bytes(body)))
            conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is h11.MUST_CLOSE:  # Connection: close, HTTP/1.0
                return outcome
            conn.start_next_cycle()


Response = tuple[int, list[tuple[str, str]], bytes]  # status, end-to-end headers, body


def _end_to_end(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


async def _client_reads(method: str, pieces: list[bytes], eof: bool) -> Response | str:
    conn = UpstreamConnection()
    conn.connection_made(FakeTransport())
    waiter = conn.send([f"{method} / HTTP/1.1\r\nHost: r\r\n\r\n".encode()], method == "HEAD")
    for piece in pieces:
        if not conn.closed and not conn.transport.is_closing():
            conn.data_received(piece)
    if eof and not conn.closed:
        conn.connection_lost(None)
    if not waiter.done():
        waiter.cancel()
        return "waiting"
    try:
        answer = waiter.result()
    except UpstreamError:
        return "refused"
    return answer.status, list(answer.headers.items()), bytes(answer.body)


def client_reads(method: str, pieces: list[bytes], eof: bool) -> Response | str:
    """The lean client's answer to ``method /``: (status, headers, body), ``"refused"`` (an UpstreamError)
    or ``"waiting"`` (not whole yet); ``eof``: the replica closes the connection after the bytes."""
    return asyncio.run(_client_reads(method, pieces, eof))


def oracle_response(method: str, stream: bytes, eof: bool) -> Response | str:
    """h11 as a client reading the answer to ``method /`` (interim 1xx answers skipped)."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
    conn.send(h11.Request(method=method, target="/", headers=[("Host", "r")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(stream)
    if eof:
        conn.receive_data(b"")
    head, body = None, bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return "refused"
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return "waiting"
        if isinstance(event, h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            headers = [(_text(k), _text(v)) for k, v in head.headers.raw_items()]
            return head.status_code, _end_to_end(headers), bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return "refused"
