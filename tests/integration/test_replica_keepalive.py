"""A replica's HTTP server keeps connections alive (`keysmanager.serve`): one connection carries many stage calls,
an unread request body never becomes the next request, and a drain closes idle kept-alive connections."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

# A replica: serve_forever on an inherited listening socket; /read echoes the body, /ignore answers without reading
# it, /peer names the client's port (one connection = one port), /slow sleeps before answering, /big answers 32 KiB.
REPLICA = textwrap.dedent("""
    import sys, time
    from keysmanager.serve import serve_forever

    def app(environ, start_response):
        path = environ["PATH_INFO"]
        if path == "/read":
            body = environ["wsgi.input"].read()
        elif path == "/slow":
            time.sleep(float(environ.get("QUERY_STRING") or 0.5))
            body = b"slow"
        elif path == "/big":
            body = b"b" * 32768
        elif path == "/peer":
            body = str(environ["REMOTE_PORT"]).encode()
        else:
            body = b"ignored"
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    serve_forever(app, int(sys.argv[1]), None, 10.0)
""")


@pytest.fixture
def replica():
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.bind(("127.0.0.1", 0))
    listen.listen(64)
    port = listen.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", REPLICA, str(listen.fileno())], pass_fds=[listen.fileno()])
    listen.close()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _call(conn: http.client.HTTPConnection, path: str, body: bytes = b"") -> tuple[http.client.HTTPResponse, bytes]:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/octet-stream"})
    res = conn.getresponse()
    return res, res.read()


def test_one_connection_carries_many_calls_and_an_unread_body_is_discarded(replica):
    _, port = replica
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    res, first = _call(conn, "/peer")
    assert res.status == 200 and res.getheader("Connection") is None
    sock = conn.sock
    for i in range(20):
        res, body = _call(conn, "/read", b"x" * (1000 + i))
        assert res.status == 200 and body == b"x" * (1000 + i)
        # the app leaves this body unread: it must not be parsed as the next request line
        res, body = _call(conn, "/ignore", b"GET /peer HTTP/1.1\r\n\r\n" + b"y" * 5000)
        assert res.status == 200 and body == b"ignored"
    res, last = _call(conn, "/peer")
    assert last == first and conn.sock is sock  # the same TCP connection all along
    conn.close()


def test_a_kept_alive_answer_is_not_held_by_nagle(replica):
    """The head and the body go out in two writes: without TCP_NODELAY the body waits for the caller's delayed ACK
    of the head (tens of ms) on every call after the first."""
    _, port = replica
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the router's client
    times = []
    for _ in range(15):
        started = time.perf_counter()
        res, body = _call(conn, "/big", b"x" * 2048)
        times.append(time.perf_counter() - started)
        assert res.status == 200 and len(body) == 32768
    conn.close()
    assert sorted(times)[len(times) // 2] < 0.02, times


def test_a_large_unread_body_closes_the_connection(replica):
    from keysmanager.serve import DRAIN_MAX

    _, port = replica
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    res, body = _call(conn, "/ignore", b"z" * (DRAIN_MAX + 4096))
    assert res.status == 200 and body == b"ignored" and res.getheader("Connection") == "close"
    res, body = _call(conn, "/read", b"after")  # http.client reconnects
    assert res.status == 200 and body == b"after"
    conn.close()


def test_a_drain_answers_the_call_in_flight_and_closes_idle_connections(replica):
    proc, port = replica
    idle = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    assert _call(idle, "/read", b"warm")[1] == b"warm"  # kept alive, now idle
    busy = socket.create_connection(("127.0.0.1", port), timeout=10)
    busy.sendall(b"POST /slow?0.5 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    time.sleep(0.2)
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    answer = b""
    while b"slow" not in answer:
        chunk = busy.recv(4096)
        if not chunk:
            break
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"slow")
    assert b"connection: close" in answer.lower()  # answered while draining: no more calls on it
    assert idle.sock.recv(1) == b""  # the idle kept-alive connection was closed, not left to a reset
    proc.wait(timeout=10)
    assert time.monotonic() - started < 5  # the idle connection did not hold the drain up
    busy.close()
    idle.close()
