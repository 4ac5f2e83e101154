"""The fast ``/function`` front (quart_provider.front): the same invoke semantics as the aiohttp handler,
over raw keep-alive sockets: pipelining, chunked bodies, limits, hand-over of everything else to aiohttp.

Answers the front wrote carry no ``Server`` header (aiohttp's carry ``Server: Python/… aiohttp/…``): that
is how these tests tell which server answered.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import uuid

import pytest
import requests
from quart_transport.codec import CodecSettings
from support.faas_cli import Running, faas_cli_deploy_body, running_echo

LIMIT = 256 * 1024
pytestmark = pytest.mark.skipif(not CodecSettings.from_env().lean,
                                reason="the fast front's own behaviour; QUART_HTTP_CODEC=aiohttp turns it off")


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    yield from running_echo(tmp_path_factory.mktemp("front"), max_body_bytes=LIMIT)


class Client:
    """One raw keep-alive connection; reads answers framed by Content-Length."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buf = b""

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        size = int(headers.get("content-length", "0"))
        while len(self.buf) < size:
            self._more()
        body, self.buf = self.buf[:size], self.buf[size:]
        return int(lines[0].split(" ")[1]), headers, body

    def closed(self) -> bool:
        """The server closed the connection (after what was read)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def _more(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("closed by the server")
        self.buf += data

    def close(self) -> None:
        self.sock.close()


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: gw", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunked(path: str, pieces: list[bytes], *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: gw", "Transfer-Encoding: chunked", *extra]
    body = b"".join(f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n" for p in pieces)
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body + b"0\r\nX-Trailer: t\r\n\r\n"


def test_keep_alive_and_pipelined_requests_are_answered_in_order_with_tracing_headers(echo):
    c = Client(echo.url)
    try:
        mine = "my-call-42"
        c.send(post("/function/echo", b"one") + chunked("/function/echo/sub/path?q=1", [b"tw", b"o"])
               + post("/function/echo.openfaas-fn", b"three", f"X-Call-Id: {mine}")
               + b"GET /function/echo HTTP/1.1\r\nHost: gw\r\n\r\n")
        answers = [c.answer() for _ in range(4)]
        assert [(s, b) for s, _, b in answers] == [(200, b"one"), (200, b"two"), (200, b"three"), (200, b"")]
        for _, headers, _ in answers:
            assert "server" not in headers  # the front answered
            assert float(headers["x-duration-seconds"]) >= 0
            assert abs(int(headers["x-start-time"]) - time.time_ns()) < 60e9
        assert uuid.UUID(answers[0][1]["x-call-id"]).version == 4
        assert answers[2][1]["x-call-id"] == mine  # the client's call id is kept
        for i in range(20):  # and the connection stays usable
            c.send(post("/function/echo", str(i).encode()))
            assert c.answer()[2] == str(i).encode()
    finally:
        c.close()


def test_a_chunked_body_trickling_in_is_read_whole(echo):
    c = Client(echo.url)
    try:
        payload = os.urandom(150_000)
        c.send(b"POST /function/echo HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(payload), 40_000):
            piece = payload[i:i + 40_000]
            line = f"{len(piece):x}\r\n".encode()
            c.send(line[:1])  # even the chunk-size line arrives in pieces
            time.sleep(0.01)
            c.send(line[1:] + piece[:100])
            time.sleep(0.01)
            c.send(piece[100:] + b"\r\n")
        c.send(b"0\r\n\r\n")
        status, _, body = c.answer()
        assert status == 200 and body == payload
        c.send(post("/function/echo", os.urandom(200_000)))  # a large Content-Length body on the same connection
        status, _, body = c.answer()
        assert status == 200 and len(body) == 200_000
    finally:
        c.close()


def test_bodies_over_the_limit_are_413_and_the_connection_closes(echo):
    c = Client(echo.url)
    try:
        c.send(f"POST /function/echo HTTP/1.1\r\nHost: gw\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode())
        status, headers, body = c.answer()  # refused before any of the body was sent
        assert status == 413 and b'"field": "body"' in body and headers["connection"] == "close"
        assert "x-call-id" in headers
        assert c.closed()
    finally:
        c.close()
    c = Client(echo.url)
    try:
        c.send(chunked("/function/echo", [b"x" * 100_000] * 3))
        status, headers, _ = c.answer()
        assert status == 413 and headers["connection"] == "close"
    finally:
        c.close()
    assert echo.system.gateway.body_gate.total == 0


def test_malformed_chunked_bodies_are_400(echo):
    for bad in (b"1_0\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n", b"+5\r\nhello\r\n0\r\n\r\n", b"3\r\nhello\r\n0\r\n\r\n"):
        c = Client(echo.url)
        try:
            c.send(b"POST /function/echo HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n" + bad)
            status, _, body = c.answer()
            assert status == 400 and b"chunk" in body, body
        finally:
            c.close()


def test_what_the_front_does_not_take_goes_to_aiohttp_on_the_same_connection(echo):
    c = Client(echo.url)
    try:
        c.send(post("/function/echo", b"fast"))
        status, headers, body = c.answer()
        assert (status, body) == (200, b"fast") and "server" not in headers
        c.send(post("/function/nope", b"?"))  # not a deployed function: the invoke hooks' path, 404
        status, headers, body = c.answer()
        assert status == 404 and b"functionName" in body and "aiohttp" in headers["server"]
        assert uuid.UUID(headers["x-call-id"])
        c.send(post("/function/echo", b"after"))  # the connection is aiohttp's now: same answer
        status, headers, body = c.answer()
        assert (status, body) == (200, b"after") and "aiohttp" in headers["server"]
        assert headers["x-call-id"] and headers["x-duration-seconds"]
    finally:
        c.close()
    c = Client(echo.url)
    try:  # Content-Length beside chunked (a smuggling shape): aiohttp's parser refuses it
        c.send(b"POST /function/echo HTTP/1.1\r\nHost: gw\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"0\r\n\r\n")
        assert c.answer()[0] == 400
    finally:
        c.close()
    c = Client(echo.url)
    try:  # a head over 8 KiB: aiohttp's limits decide (a 6 KiB header passes them)
        c.send(post("/function/echo", b"big head", "X-Pad: " + "p" * 6000, "X-Pad-2: " + "q" * 6000))
        status, headers, body = c.answer()
        assert (status, body) == (200, b"big head") and "aiohttp" in headers["server"]
    finally:
        c.close()
    health = requests.get(f"{echo.url}/healthz", timeout=5)
    assert health.status_code == 200
    assert requests.get(f"{echo.url}/system/functions", timeout=5).status_code == 401


def test_connection_close_and_half_close_are_honoured(echo):
    c = Client(echo.url)
    try:
        c.send(post("/function/echo", b"a") + post("/function/echo", b"b", "Connection: close"))
        assert c.answer()[2] == b"a"
        status, headers, body = c.answer()
        assert body == b"b" and headers["connection"] == "close" and c.closed()
    finally:
        c.close()
    c = Client(echo.url)
    try:  # two pipelined requests, then the client shuts its side: both are answered
        c.send(post("/function/echo", b"x") + post("/function/echo", b"y"))
        c.sock.shutdown(socket.SHUT_WR)
        assert [c.answer()[2] for _ in range(2)] == [b"x", b"y"]
    finally:
        c.close()


def test_a_killed_replica_is_retried_through_the_front(tmp_path):
    running = Running(tmp_path)
    try:
        assert running.deploy(faas_cli_deploy_body("phoenix")).status_code == 202
        running.wait_available("phoenix", 1)
        c = Client(running.url)
        c.send(post("/function/phoenix", b"warm"))
        assert c.answer()[0] == 200  # the gateway now holds a pooled connection to the replica
        [old] = running.call(running.system.gateway.hosts["host-0"].replicas())
        os.kill(old.pid, signal.SIGKILL)
        time.sleep(0.05)
        c.send(post("/function/phoenix", b"again"))  # refused (or reset): held, then the replacement answers
        status, headers, body = c.answer()
        assert "server" not in headers
        assert (status, body) == (200, b"again") or (status == 502 and b"phoenix" in body), body
        c.close()
    finally:
        running.close()


def test_a_429_from_the_byte_gate_carries_retry_after(tmp_path):
    running = Running(tmp_path, max_body_bytes=1 << 20, max_inflight_bytes=400_000,
                      max_function_inflight_bytes=300_000)
    try:
        assert running.deploy(faas_cli_deploy_body("echo")).status_code == 202
        running.wait_available("echo", 1)
        slow = Client(running.url)
        slow.send(b"POST /function/echo HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
                  + f"{250_000:x}\r\n".encode() + b"a" * 250_000 + b"\r\n")
        deadline = time.monotonic() + 5
        while running.system.gateway.body_gate.total < 250_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        c = Client(running.url)
        c.send(post("/function/echo", b"y" * 100_000))
        status, headers, _ = c.answer()
        assert status == 429 and int(headers["retry-after"]) >= 1 and "server" not in headers
        assert re.fullmatch(r"[0-9a-f-]{36}", headers["x-call-id"])
        c.close()
        slow.send(b"0\r\n\r\n")
        assert slow.answer()[0] == 200
        slow.close()
    finally:
        running.close()
