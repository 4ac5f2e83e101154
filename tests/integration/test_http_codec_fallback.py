"""``QUART_HTTP_CODEC=aiohttp`` (quart_transport.codec): both hand-written HTTP/1.1 codecs off. aiohttp's server
answers ``/function`` and the client to replicas is an aiohttp ClientSession, with the lean client's calls,
answers and errors (the conformance of the lean codecs themselves: tests/unit/test_http1_conformance.py)."""

from __future__ import annotations

import asyncio

import pytest
import requests
from quart_stage.settings import ConfigError
from quart_transport.codec import CodecSettings, upstream_pool
from quart_transport.upstream import UpstreamError, UpstreamPool, UpstreamRefused, UpstreamTimeout
from quart_transport.upstream_aiohttp import AiohttpUpstreamPool
from support.faas_cli import Running, faas_cli_deploy_body
from support.raw_http import closed_port, serve


def test_the_setting_picks_the_client_and_refuses_an_unknown_codec() -> None:
    assert isinstance(upstream_pool(1.0, codec=CodecSettings()), UpstreamPool)
    assert isinstance(upstream_pool(1.0, codec=CodecSettings.from_env({"QUART_HTTP_CODEC": "aiohttp"})),
                      AiohttpUpstreamPool)
    with pytest.raises(ConfigError, match="QUART_HTTP_CODEC"):
        CodecSettings.from_env({"QUART_HTTP_CODEC": "h2"})


def test_the_aiohttp_client_answers_and_fails_as_the_lean_one() -> None:
    async def main() -> None:
        seen: list[bytes] = []
        answers = [
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n\r\nhello",
            b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n",
        ]
        server, url = await serve(answers, seen)
        pool = AiohttpUpstreamPool(timeout_s=5)
        try:
            calls = [("POST", "/a/b?x=1", {"X-Call-Id": "c1"}, b"body!"), ("POST", "/", {}, b"x" * 40000)]
            got = [await pool.request(method, url, path, headers, body) for method, path, headers, body in calls]
            assert [(r.status, bytes(r.body)) for r in got] == [(200, b"hello"), (201, b"abcde")]
            assert got[0].headers.getall("Set-Cookie") == ["a=1", "b=2"] and got[0].headers["X-A"] == "1"
            assert not {"Content-Length", "Transfer-Encoding"} & {k for r in got for k in r.headers}
            async with await pool.stream("GET", url, "/s", {}, b"") as stream:
                assert stream.status == 200 and await stream.read() == b"abcd"
            first = seen[0]
            assert first.startswith(b"POST /a/b?x=1 HTTP/1.1\r\n") and b"X-Call-Id: c1\r\n" in first
            assert first.endswith(b"body!") and b"User-Agent" not in first
        finally:
            server.close()
        with pytest.raises(UpstreamRefused):
            await pool.request("POST", f"http://127.0.0.1:{closed_port()}", "/", {}, b"x")
        server, url = await serve([b"SILENT"], [])
        try:
            with pytest.raises(UpstreamTimeout, match="no answer within 0.2 s"):
                await pool.request("POST", url, "/", {}, b"x", timeout_s=0.2)
        finally:
            server.close()
        server, url = await serve([b"NOT HTTP\r\n\r\n"], [])
        try:
            with pytest.raises(UpstreamError):
                await pool.request("POST", url, "/", {}, b"x")
        finally:
            server.close()
        await pool.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_with_the_fallback_aiohttp_serves_function_calls(tmp_path, monkeypatch) -> None:
    """The front answers without a ``Server`` header, aiohttp with one: here every answer is aiohttp's."""
    monkeypatch.setenv("QUART_HTTP_CODEC", "aiohttp")
    running = Running(tmp_path)
    try:
        assert running.deploy(faas_cli_deploy_body("echo")).status_code == 202
        running.wait_available("echo", 1)
        with requests.Session() as session:
            for i in range(3):
                res = session.post(f"{running.url}/function/echo/x?i={i}", data=b"ping %d" % i, timeout=10)
                assert res.status_code == 200 and res.content == b"ping %d" % i
                assert "aiohttp" in res.headers.get("Server", "")
            res = session.post(f"{running.url}/function/echo", data=(b"y" * 1000 for _ in range(3)), timeout=10)
            assert res.status_code == 200 and res.content == b"y" * 3000  # a chunked request body
    finally:
        running.close()
