"""A raw HTTP/1.1 server for the clients to replicas (tests/integration/test_upstream.py, test_http_codec_fallback.py):
it answers with exactly the bytes it is given, malformed ones included."""

from __future__ import annotations

import asyncio
import socket


async def serve(answers: list[bytes], seen: list[bytes], close_after: bool = False):
    """A server answering the n-th request head it reads (whole request: head + Content-Length body) with answers[n]."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                seen.append(head + body)
                answer = answers.pop(0)
                if answer == b"RESET":
                    writer.transport.abort()
                    return
                if answer == b"SILENT":
                    await asyncio.sleep(10)
                    return
                writer.write(answer)
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): a connection to it is refused."""
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    return port
