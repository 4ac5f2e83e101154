"""The built-in ``quart/echo`` function: a minimal, fast HTTP/1.1 keep-alive echo replica.

It answers ``GET /_/health`` with 200 and any other request with its body (status 200), so the
gateway benchmark measures the gateway, not the function. It serves on the socket inherited in
``QUART_LISTEN_FD`` (see :class:`quart_provider.hosts.ProcessHost`) or ``--port``.
Bodies carry ``Content-Length`` or ``Transfer-Encoding: chunked`` (the OpenFaaS gateway forwards
bodies chunked); chunk extensions and trailers are read and dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 64 * 1024


def dechunk(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """The body of a chunked message starting at ``buffer[start]`` and the offset just past it (trailers
    included); None while incomplete; ValueError when malformed."""
    pieces, pos = [], start
    while True:
        eol = buffer.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buffer[pos:eol]).split(b";", 1)[0].strip() or b"x", 16)  # ValueError if not hex
        if size < 0:
            raise ValueError("negative chunk size")
        pos = eol + 2
        if size == 0:
            while True:  # trailer fields, up to an empty line
                eol = buffer.find(b"\r\n", pos)
                if eol < 0:
                    return None
                if eol == pos:
                    return b"".join(pieces), eol + 2
                pos = eol + 2
        if len(buffer) < pos + size + 2:
            return None
        if buffer[pos + size:pos + size + 2] != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        pieces.append(bytes(buffer[pos:pos + size]))
        pos += size + 2


class EchoProtocol(asyncio.Protocol):
    """Parses requests from a byte stream; answers each with its own body."""

    __slots__ = ("transport", "buffer")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(_HEAD_END)
            if end < 0:
                if len(self.buffer) > _MAX_HEAD:
                    self._reply(431, b"", close=True)
                return
            head = bytes(self.buffer[:end]).decode("latin-1")
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3:
                self._reply(400, b"bad request line", close=True)
                return
            length, close, chunked, lengths = 0, parts[2] == "HTTP/1.0", False, set()
            for line in lines[1:]:
                name, _, value = line.partition(":")
                key = name.strip().lower()
                if key == "content-length":
                    lengths.add(value.strip())
                elif key == "transfer-encoding":
                    chunked = value.strip().lower().endswith("chunked")
                elif key == "connection":
                    close = value.strip().lower() == "close"
            if lengths:  # digits only, one value, never beside chunked (RFC 9112 6.3): else 400 and close
                raw = lengths.pop()
                if lengths or chunked or not raw.isdigit() or not raw.isascii() or len(raw) > 12:
                    self._reply(400, b"bad Content-Length", close=True)
                    return
                length = int(raw)
            if chunked:
                try:
                    framed = dechunk(self.buffer, end + 4)
                except ValueError:
                    self._reply(400, b"bad chunked body", close=True)
                    return
                if framed is None:
                    return
                body, total = framed
            else:
                total = end + 4 + length
                if len(self.buffer) < total:
                    return
                body = bytes(self.buffer[end + 4:total])
            del self.buffer[:total]
            self._reply(200, b"" if parts[1] == "/_/health" else body, close)
            if close:
                return

    def _reply(self, status: int, body: bytes, close: bool) -> None:
        reason = {200: "OK", 400: "Bad Request", 431: "Headers Too Large"}[status]
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/octet-stream\r\n"
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
    fd = os.environ.get("QUART_LISTEN_FD")
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
