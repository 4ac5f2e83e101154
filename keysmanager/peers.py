"""Stage files between KeysManagers (BlitzScale's peer fetch): the serving side and the fetching side.

A KeysManager that holds a stage's file (fetched from the registry or a peer, or the stage's own
``QUART_MODEL_DIR``) serves it on ``GET /v1/stages/{function}/file`` (the API's token middleware guards it on
TCP), with ``Range`` support and the manifest's sha256 and size in headers. A file still arriving is served
as it grows (serial forwarding: the next host of a chain gets each chunk as soon as it is written here); if
that transfer fails, the answer is cut short and the reader falls back.

The fetching side (:func:`stream_from_peer`) runs in a worker thread and writes through the same
``keysmanager.transfer.VerifiedWriter`` as the registry path.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from keysmanager.auth import bearer_header
from keysmanager.transfer import FetchResult, TransferError, VerifiedWriter

PEER_CHUNK_BYTES = 1 << 20  # a read buffer; a chain forwards FORWARD_BYTES at a time (about that much time per hop)
SHA_HEADER = "X-Quart-Sha256"
SIZE_HEADER = "X-Quart-Stage-Bytes"
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_POLL_S = 0.005
FORWARD_BYTES = 4 * PEER_CHUNK_BYTES  # a file still arriving is forwarded once this much is new (32 ms at 1 Gbit/s)
_HOLD_S = 0.02  # ... or once the oldest byte not sent has waited this long (a slow or stalled upstream)
RECEIVE_PATHS = ("copy", "splice")  # splice: socket → pipe → file, hashed in place (Linux)
GATHER_BYTES, _GATHER_S = 256 << 10, 0.002  # a receiver whose read got less sleeps 2 ms: ~250 kB a read at 1 Gbit/s


@dataclass(frozen=True, slots=True)
class StageFile:
    """A stage file this host can serve: complete at ``path``, or still arriving through ``writer``."""

    function: str
    path: Path
    sha256: str
    size: int
    writer: VerifiedWriter | None = None

    @property
    def complete(self) -> bool:
        return self.writer is None or self.writer.state == "done"


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a single ``bytes=a-b`` range; None for the whole file. ValueError when it is
    malformed or outside the file."""
    if header is None:
        return None
    m = _RANGE_RE.match(header.strip())
    if m is None or m.groups() == ("", ""):
        raise ValueError(f"unsupported Range {header!r}: expected bytes=START-END")
    first, last = m.groups()
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start, end = int(first), size if last == "" else min(size, int(last) + 1)
    if start >= end:
        raise ValueError(f"Range {header!r} is outside the file's {size} bytes")
    return start, end


async def serve_file(request: web.Request, stage: StageFile) -> web.StreamResponse:
    """Stream ``stage`` (a range of it with ``Range``); bytes still arriving are sent as they land."""
    try:
        span = parse_range(request.headers.get("Range"), stage.size)
    except ValueError as exc:
        return web.json_response({"error": str(exc), "field": "Range"}, status=416,
                                 headers={"Content-Range": f"bytes */{stage.size}"})
    start, end = span or (0, stage.size)
    headers = {SHA_HEADER: stage.sha256, SIZE_HEADER: str(stage.size), "Accept-Ranges": "bytes",
               "Content-Type": "application/octet-stream"}
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{stage.size}"
    response = web.StreamResponse(status=206 if span else 200, headers=headers)
    response.content_length = end - start
    loop = asyncio.get_running_loop()
    with await _open_when_there(stage) as f:  # before any header: a file that is not there is an error answer
        await response.prepare(request)
        pos, held_since = start, None
        while pos < end:
            available = end if stage.complete else min(end, stage.writer.written)
            if available > pos and held_since is None:
                held_since = loop.time()
            if available <= pos or (available - pos < FORWARD_BYTES and available < end
                                    and loop.time() - held_since < _HOLD_S):
                # a file still arriving goes on in FORWARD_BYTES pieces: a sendfile per 2 ms poll (a few hundred kB)
                # cost the forwarding host as much CPU as its own receiving (a chain of 4 on 2 cores, half the NIC)
                if stage.writer is not None and stage.writer.state == "failed":
                    return _cut(request, response)  # the transfer here failed: the reader tries its next source
                await asyncio.sleep(_POLL_S)
                continue
            held_since = None
            pos += await _send(request, response, f, pos, min(available, pos + PEER_CHUNK_BYTES * 16) - pos)
    await response.write_eof()
    return response


def _cut(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """End an answer whose headers (the whole length) are out: only a cut connection tells the reader at once
    (an error answer written after them would reach it as body bytes, and it would wait for the rest)."""
    if request.transport is not None:
        request.transport.abort()
    return response


async def _open_when_there(stage: StageFile, timeout_s: float = 10.0):
    """The file to serve. A transfer is registered here as its writer opens, a moment before the partial file is
    there (a landing reserve renamed, ``keysmanager.landing``): a reader asking in between waits for it.
    FileNotFoundError when neither the partial nor the final file is there and the transfer is not opening."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return _open(stage)
        except FileNotFoundError:
            writer = stage.writer
            if writer is None or writer.state != "writing" or writer.written or loop.time() > deadline:
                raise
        await asyncio.sleep(_POLL_S)


async def _send(request: web.Request, response: web.StreamResponse, f, offset: int, count: int) -> int:
    """``count`` bytes of ``f`` from ``offset``: by sendfile (no copy through Python), else read and write."""
    transport = request.transport
    if transport is not None:
        with contextlib.suppress(NotImplementedError):
            return await asyncio.get_running_loop().sendfile(transport, f, offset, count)
    f.seek(offset)
    chunk = f.read(count)
    await response.write(chunk)
    return len(chunk)


def _open(stage: StageFile):
    """The file, by its partial name while it arrives (renamed to ``path`` once verified: then open that)."""
    if stage.writer is not None:
        try:
            return open(stage.writer.partial, "rb")  # noqa: SIM115 - closed by the caller's with
        except FileNotFoundError:
            pass
    return open(stage.path, "rb")  # noqa: SIM115


def _peer_connection(peer: str, connect_timeout_s: float) -> http.client.HTTPConnection:
    """An unconnected connection to the KeysManager at ``peer``; TransferError unless it is ``http://HOST:PORT``."""
    parts = urlsplit(peer)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise TransferError(f"peer {peer!r} is not http://HOST:PORT")
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=connect_timeout_s)


def stream_from_peer(peer: str, function: str, token: str | None, writer: VerifiedWriter,
                     connect_timeout_s: float = 3.0, read_timeout_s: float = 10.0, receive: str = "copy") -> FetchResult:
    """Stream ``function``'s stage file from the KeysManager at ``peer`` (``http://HOST:PORT``) into ``writer``
    and commit it (size and sha256 checked there). TransferError naming the peer and the cause.

    Plain ``http.client`` reading into one reused buffer (no per-chunk allocation): at a NIC's rate the
    receiving side's CPU is what a chain of forwarders on a small machine runs out of."""
    conn = _peer_connection(peer, connect_timeout_s)
    try:
        conn.connect()
        conn.sock.settimeout(read_timeout_s)
        conn.request("GET", f"/v1/stages/{function}/file", headers=bearer_header(token) if token else {})
        reply = conn.getresponse()
        if reply.status != 200:
            raise TransferError(f"peer {peer} answered {reply.status}: {_error_text(reply.read(4096))}")
        offered = reply.getheader(SHA_HEADER)
        if writer.sha256 and offered and offered != writer.sha256:
            raise TransferError(f"peer {peer} holds another version of {function} (sha256 {offered[:16]}…)")
        if receive == "splice" and reply.length and not reply.chunked and writer.can_splice:
            _splice_body(conn.sock, reply, writer, read_timeout_s)
            return writer.commit(source=peer)
        buffer = memoryview(bytearray(PEER_CHUNK_BYTES))
        remaining = reply.length  # Content-Length (None: until the peer closes)
        while remaining is None or remaining > 0:
            # readinto1: what has arrived (one socket read), not a full buffer: a live writer verifies and
            # announces each layer as soon as its last byte lands, not a chunk later
            view = buffer if remaining is None else buffer[:min(len(buffer), remaining)]
            n = reply.fp.readinto1(view)
            if not n:
                break
            writer.write(view[:n])
            if remaining is not None:
                remaining -= n
            if n < GATHER_BYTES:  # a packet or two: let the next read find more (fewer wakes, writes and updates)
                time.sleep(_GATHER_S)
    except (OSError, http.client.HTTPException) as exc:
        raise TransferError(f"peer {peer}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    return writer.commit(source=peer)


def _splice_body(sock: socket.socket, reply: http.client.HTTPResponse, writer: VerifiedWriter,
                 read_timeout_s: float) -> None:
    """The body of ``reply`` (``reply.length`` bytes) into ``writer``: what http.client already buffered by a
    write, the rest spliced from the socket into the file (``VerifiedWriter.splice_from``). A short body is
    left to the writer's commit (it names the count); a silent peer is a TimeoutError."""
    remaining = reply.length
    buffered = reply.fp.peek(1)[:remaining]  # bytes read with the headers (one socket read at most)
    if buffered:
        writer.write(reply.fp.read1(len(buffered)))
        remaining -= len(buffered)
    buffer = memoryview(bytearray(PEER_CHUNK_BYTES))
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while remaining > 0:
        try:
            if writer.can_splice:
                n = writer.splice_from(sock.fileno(), min(PEER_CHUNK_BYTES, remaining))
            else:  # bytes an earlier live attempt verified: hashed through a buffer, not rewritten
                n = sock.recv_into(buffer[:min(len(buffer), remaining)], socket.MSG_DONTWAIT)
                writer.write(buffer[:n])
        except BlockingIOError:  # the socket has a timeout, so it is non-blocking: wait for bytes
            if not poller.poll(read_timeout_s * 1000):
                raise TimeoutError(f"no bytes for {read_timeout_s} s") from None
            continue
        if not n:
            return
        remaining -= n
        if n < GATHER_BYTES:
            time.sleep(_GATHER_S)


def read_peer_range(peer: str, function: str, token: str | None, sha256: str | None, start: int, end: int,
                    connect_timeout_s: float = 3.0, read_timeout_s: float = 10.0) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of ``function``'s stage file at the KeysManager ``peer`` (``Range``), in chunks;
    TransferError when it answers anything but 206 for that file (``sha256``, when given, must be the one it
    offers). Unverified: the caller checks each layer (a part start, ``keysmanager.parts``)."""
    conn = _peer_connection(peer, connect_timeout_s)
    try:
        conn.connect()
        conn.sock.settimeout(read_timeout_s)
        headers = {"Range": f"bytes={start}-{end - 1}", **(bearer_header(token) if token else {})}
        conn.request("GET", f"/v1/stages/{function}/file", headers=headers)
        reply = conn.getresponse()
        if reply.status != 206:
            raise TransferError(f"peer {peer} answered {reply.status}: {_error_text(reply.read(4096))}")
        offered = reply.getheader(SHA_HEADER)
        if sha256 and offered and offered != sha256:
            raise TransferError(f"peer {peer} holds another version of {function} (sha256 {offered[:16]}…)")
        while chunk := reply.read1(PEER_CHUNK_BYTES):  # what has arrived: each layer verifies as it lands
            yield chunk
    except (OSError, http.client.HTTPException) as exc:
        raise TransferError(f"peer {peer}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error"))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")
