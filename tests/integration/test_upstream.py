"""The proxy's upstream client (:mod:`quart_transport.upstream`) against raw HTTP/1.1 servers: framings, reuse, errors."""

from __future__ import annotations

import asyncio

import pytest
from quart_transport.upstream import UpstreamError, UpstreamPool, UpstreamRefused, UpstreamTimeout
from support.raw_http import closed_port, serve


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_content_length_chunked_and_close_delimited_answers_and_keep_alive():
    async def main():
        seen: list[bytes] = []
        answers = [
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n\r\nhello",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nGET",
            b"HTTP/1.1 204 No Content\r\n\r\n",
        ]
        big = b"B" * 100_000
        answers.append(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + big)
        server, url = await serve(answers, seen)
        pool = UpstreamPool(timeout_s=5)
        try:
            r1 = await pool.request("POST", url, "/a/b?x=1", {"X-Call-Id": "c1"}, b"body!")
            assert (r1.status, r1.body, r1.headers["X-A"]) == (200, b"hello", "1")
            assert r1.headers.getall("Set-Cookie") == ["a=1", "b=2"] and "Content-Length" not in r1.headers
            r2 = await pool.request("POST", url, "/", {}, b"x" * 40000)
            assert (r2.status, r2.body) == (201, b"abcde") and "Transfer-Encoding" not in r2.headers
            r3 = await pool.request("GET", url, "/g", {}, b"")
            assert r3.body == b"GET"
            r4 = await pool.request("DELETE", url, "/d", {}, b"")
            assert (r4.status, r4.body) == (204, b"")
            r5 = await pool.request("POST", url, "/big", {}, b"")
            assert r5.body == big
            assert sum(len(v) for v in pool.idle.values()) == 1  # one connection, kept alive across all five
            assert seen[0].startswith(b"POST /a/b?x=1 HTTP/1.1\r\nHost: 127.0.0.1:") and b"X-Call-Id: c1\r\n" in seen[0]
            assert seen[0].endswith(b"Content-Length: 5\r\n\r\nbody!") and seen[1].endswith(b"x" * 40000)
            assert b"Content-Length" not in seen[2] and b"Content-Length: 0\r\n" in seen[3]
        finally:
            await pool.close()
            server.close()

    run(main())


def test_head_answer_has_no_body_and_close_delimited_body_ends_at_close():
    async def main():
        seen: list[bytes] = []
        server, url = await serve([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"], seen)
        server2, url2 = await serve([b"HTTP/1.0 200 OK\r\n\r\nup to the close"], [], close_after=True)
        pool = UpstreamPool(timeout_s=5)
        try:
            r = await pool.request("HEAD", url, "/", {}, b"")
            assert (r.status, r.body) == (200, b"")
            r = await pool.request("POST", url2, "/", {}, b"q")
            assert r.body == b"up to the close"
            assert not pool.idle.get(("127.0.0.1", int(url2.rsplit(":", 1)[1])))  # not kept
        finally:
            await pool.close()
            server.close()
            server2.close()

    run(main())


def test_refused_reset_timeout_and_malformed():
    async def main():
        pool = UpstreamPool(timeout_s=0.5)
        with pytest.raises(UpstreamRefused):
            await pool.request("POST", f"http://127.0.0.1:{closed_port()}", "/", {}, b"x")
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        server, url = await serve([ok, b"RESET"], [])
        try:
            await pool.request("POST", url, "/", {}, b"x")
            with pytest.raises(UpstreamError) as info:  # a kept-alive connection reset: not "refused"
                await pool.request("POST", url, "/", {}, b"x")
            assert not isinstance(info.value, UpstreamRefused)
        finally:
            server.close()
        server, url = await serve([b"RESET"], [])
        try:  # a fresh connection reset before any answer: the replica never took it
            with pytest.raises(UpstreamRefused):
                await pool.request("POST", url, "/", {}, b"x")
        finally:
            server.close()
        server, url = await serve([b"SILENT"], [])
        try:
            with pytest.raises(UpstreamTimeout, match="no answer within 0.2 s"):
                await pool.request("POST", url, "/", {}, b"x", timeout_s=0.2)  # this request's own timeout
        finally:
            server.close()
        server, url = await serve([b"NOT HTTP\r\n\r\n"], [])
        try:
            with pytest.raises(UpstreamError, match="malformed"):
                await pool.request("POST", url, "/", {}, b"x")
        finally:
            server.close()
        await pool.close()

    run(main())


def test_a_streamed_answer_comes_piece_by_piece_and_its_connection_is_reused():
    async def main():
        sent = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"7\r\ntoken-1\r\n")
            await writer.drain()
            await sent.wait()  # the client has the first piece before the second exists
            writer.write(b"7\r\ntoken-2\r\n0\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")  # a second request on the same connection
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nabcdef")
            await writer.drain()
            await reader.read()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = UpstreamPool(timeout_s=5)
        try:
            async with await pool.stream("POST", url, "/generate", {}, b"prompt") as stream:
                assert stream.status == 200 and stream.headers["Content-Type"] == "text/event-stream"
                pieces = []
                async for piece in stream:
                    pieces.append(piece)
                    sent.set()
            assert pieces == [b"token-1", b"token-2"]
            again = await pool.stream("GET", url, "/", {}, b"")
            assert await again.read() == b"abcdef"
            assert sum(len(v) for v in pool.idle.values()) == 1  # the one connection, back in the pool
        finally:
            await pool.close()
            server.close()

    run(main())


def test_a_stream_that_dies_or_stalls_mid_body_is_an_error():
    async def main():
        server, url = await serve([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"], [], close_after=True)
        pool = UpstreamPool(timeout_s=5)
        try:
            stream = await pool.stream("POST", url, "/", {}, b"x")
            assert await stream.__anext__() == b"abc"
            with pytest.raises(UpstreamError):
                await stream.read()
            async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab")
                await asyncio.sleep(5)  # the rest never comes
                writer.close()

            stalled = await asyncio.start_server(stall, "127.0.0.1", 0)
            stall_url = f"http://127.0.0.1:{stalled.sockets[0].getsockname()[1]}"
            slow = await pool.stream("POST", stall_url, "/", {}, b"x", idle_s=0.2)
            assert await slow.__anext__() == b"ab"
            with pytest.raises(UpstreamTimeout):
                await slow.read()
            stalled.close()
            assert not pool.busy
        finally:
            await pool.close()
            server.close()

    run(main())
