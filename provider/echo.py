"""The built-in ``quart/echo`` function: a minimal, fast HTTP/1.1 keep-alive echo replica.

It answers ``GET /_/health`` with 200 and any other request with its body (status 200), so the
gateway benchmark measures the gateway, not the function. It serves on the socket inherited in
``QUART_LISTEN_FD`` (see :class:`quart_provider.hosts.ProcessHost`) or ``--port``.
Bodies carry ``Content-Length`` or ``Transfer-Encoding: chunked`` (the OpenFaaS gateway forwards
bodies chunked); chunk extensions and trailers are read and dropped. Every request but the health probe
gets an access line on stderr (the function's log; ``quart_stage.logs``), written in batches.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time

from quart_stage.logs import format_line, log_settings
from quart_stage.settings import setting
from quart_transport.http1 import dechunk

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 64 * 1024

_OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: "
_REASONS = {200: "OK", 400: "Bad Request", 431: "Headers Too Large"}


def _frame(head: bytes) -> tuple[bytes, int, bool, bool] | str:
    """(target, Content-Length, chunked, close) of a request head, or what is wrong with it.

    The common head (no Transfer-Encoding, no Connection, at most one Content-Length) is read with a few
    byte searches; any other goes through every header line."""
    first = head.find(b"\r\n")
    parts = (head if first < 0 else head[:first]).split(b" ")
    if len(parts) != 3:
        return "bad request line"
    close = parts[2] == b"HTTP/1.0"
    lower = head.lower()
    if b"\r\ntransfer-encoding:" not in lower and b"\r\nconnection:" not in lower:
        at = lower.find(b"\r\ncontent-length:")
        if at < 0:
            return parts[1], 0, False, close
        if lower.find(b"\r\ncontent-length:", at + 17) < 0:
            eol = head.find(b"\r\n", at + 17)
            raw = head[at + 17:eol if eol >= 0 else len(head)].strip(b" \t")
            if not raw.isdigit() or len(raw) > 12:
                return "bad Content-Length"
            return parts[1], int(raw), False, close
    lengths, chunked = set(), False
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        key = name.strip().lower()
        if key == "content-length":
            lengths.add(value.strip())
        elif key == "transfer-encoding":
            chunked = value.strip().lower().endswith("chunked")
        elif key == "connection":
            close = value.strip().lower() == "close"
    length = 0
    if lengths:  # digits only, one value, never beside chunked (RFC 9112 6.3): else 400 and close
        raw_text = lengths.pop()
        if lengths or chunked or not raw_text.isdigit() or not raw_text.isascii() or len(raw_text) > 12:
            return "bad Content-Length"
        length = int(raw_text)
    return parts[1], length, chunked, close


def _header(head: bytes, lower_name: bytes) -> str:
    """The value of header ``lower_name`` in a request head, or ''."""
    key = b"\r\n" + lower_name + b":"
    at = head.lower().find(key)
    if at < 0:
        return ""
    eol = head.find(b"\r\n", at + len(key))
    return head[at + len(key):eol if eol >= 0 else len(head)].strip().decode("latin-1")


class AccessLines:
    """Access lines gathered for a moment and written to stderr together (one write per batch)."""

    def __init__(self, json_format: bool, delay_s: float = 0.05) -> None:
        self.json, self.delay_s, self.lines, self.pending = json_format, delay_s, [], False

    def add(self, head: bytes, target: bytes, status: int, bytes_in: int, bytes_out: int, started: float) -> None:
        fields = {"call_id": _header(head, b"x-call-id") or _header(head, b"x-quart-request-id") or "-",
                  "method": head[:head.find(b" ")].decode("latin-1"), "path": target.decode("latin-1"),
                  "status": status, "duration_ms": round(1000 * (time.perf_counter() - started), 3),
                  "bytes_in": bytes_in, "bytes_out": bytes_out, "pid": os.getpid()}
        self.lines.append(format_line("INFO", "access", fields, self.json))
        if not self.pending:
            try:
                asyncio.get_running_loop().call_later(self.delay_s, self.flush)
                self.pending = True
            except RuntimeError:  # driven without a loop (tests): at once
                self.flush()

    def flush(self) -> None:
        self.pending = False
        if self.lines:
            data, self.lines = ("\n".join(self.lines) + "\n").encode(errors="replace"), []
            os.write(2, data)


ACCESS = AccessLines(log_settings().format == "json")


class EchoProtocol(asyncio.Protocol):
    """Parses requests from a byte stream; answers each with its own body.

    A segment that starts with a request is parsed in place (no copy into a buffer); a request spanning
    segments waits in ``buffer`` (``need``: the bytes it needs when its head said so)."""

    __slots__ = ("transport", "buffer", "need")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = bytearray()
        self.need = 0

    def data_received(self, data: bytes) -> None:
        if self.buffer:
            self.buffer += data
            if len(self.buffer) < self.need:
                return  # a body still arriving
            data, self.buffer, self.need = bytes(self.buffer), bytearray(), 0
        pos, size, arrived = 0, len(data), time.perf_counter()
        while pos < size:
            end = data.find(_HEAD_END, pos)
            if end < 0:
                if size - pos > _MAX_HEAD:
                    self._reply(431, b"", close=True)
                    return
                break
            framed = _frame(data[pos:end])
            if isinstance(framed, str):
                self._reply(400, framed.encode(), close=True)
                return
            target, length, chunked, close = framed
            if chunked:
                try:
                    dechunked = dechunk(data, end + 4)
                except ValueError:
                    self._reply(400, b"bad chunked body", close=True)
                    return
                if dechunked is None:
                    break
                body, total = dechunked
            else:
                total = end + 4 + length
                if total > size:
                    self.need = total - pos
                    break
                body = data[end + 4:total]
            head, pos = data[pos:end], total
            if target == b"/_/health":
                self._reply(200, b"", close)
            else:
                self._reply(200, body, close)
                ACCESS.add(head, target, 200, len(body), len(body), arrived)
            if close:
                return
        if pos < size:
            self.buffer += memoryview(data)[pos:]

    def _reply(self, status: int, body: bytes, close: bool) -> None:
        if status == 200 and not close:
            self.transport.write(b"".join((_OK_HEAD, str(len(body)).encode(), b"\r\n\r\n", body)))
            return
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {len(body)}\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n"
        )
        self.transport.write(head.encode("latin-1") + body)
        if close:
            self.transport.close()


async def serve(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EchoProtocol, sock=sock)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="listen on 127.0.0.1:PORT instead of QUART_LISTEN_FD")
    args = parser.parse_args(argv)
    fd = setting("QUART_LISTEN_FD", str, "") or None
    if fd and not args.port:
        sock = socket.socket(fileno=int(fd))
    else:
        sock = socket.create_server(("127.0.0.1", args.port))
        print(sock.getsockname()[1], flush=True)
    print(f"quart/echo listening on {sock.getsockname()[0]}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        pass
    try:
        asyncio.run(serve(sock))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
