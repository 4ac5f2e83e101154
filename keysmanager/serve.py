"""A replica's HTTP server: the stage's WSGI app on a listening socket the parent already bound.

Runs in the replica (a forked child of a zygote, or a cold process). Threads are created here, after the
fork, never before. The server answers concurrent requests on threads (HTTP/1.1 keep-alive), writes one
access line per request to stderr, the replica's log (``quart_stage.logs.AccessLog``; no logging handler is
inherited across fork), stops accepting on SIGTERM and exits once the
requests in flight are answered (drain), and exits at once when the KeysManager's lifeline pipe closes.

Keep-alive: werkzeug answers every request ``Connection: close`` (a new connection, accept and handler thread per
stage call) and, after each answer, reads whatever the connection holds for 10 ms to discard an unread body — which
on a kept-alive connection would swallow the next request. `_KeepAliveHandler` reads the body through its own
``Content-Length``-bounded stream, discards only what the app left of *that* body (up to ``DRAIN_MAX`` bytes,
else it closes), and keeps the connection open for the next request (HTTP/1.1, not asked to close; a chunked
request body or one over ``DRAIN_MAX`` unread still closes), with ``TCP_NODELAY``. On drain, idle kept-alive
connections are closed.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import socket
import socketserver
import threading
import time
from typing import Any

from quart_stage.logs import AccessLog
from werkzeug.serving import DechunkedInput, ThreadedWSGIServer, WSGIRequestHandler
from werkzeug.wsgi import LimitedStream

DRAIN_MAX = 1 << 20  # unread request body a kept-alive connection discards; beyond it the connection closes
IDLE_TIMEOUT_S = 120.0  # a kept-alive connection silent this long is closed (the router's pool drops its at 60 s)


class _QuietHandler(WSGIRequestHandler):
    """No werkzeug request lines (AccessLog writes ours); counts a request as in flight from its request line to its response's end
    (``_counted``; an idle keep-alive connection is not in flight, so it does not hold a drain up)."""

    def handle_one_request(self) -> None:
        self._counted = False
        try:
            super().handle_one_request()
        finally:
            if self._counted:
                self._counted = False
                self.server.in_flight.leave()

    def parse_request(self) -> bool:
        self.server.in_flight.enter()
        self._counted = True
        return super().parse_request()

    def log_request(self, *args: Any, **kwargs: Any) -> None:  # no per-request log lines
        pass

    def log(self, type: str, message: str, *args: Any) -> None:  # errors go to stderr (the process log)
        if type == "error":
            os.write(2, (message % args + "\n").encode(errors="replace"))


class _KeepAliveHandler(_QuietHandler):
    """HTTP/1.1 keep-alive on werkzeug's handler (see the module docstring)."""

    timeout = IDLE_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            # werkzeug writes the head, then the body: on a kept-alive connection Nagle would hold the body's last
            # segment until the caller's delayed ACK of the head (up to 40 ms)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)

    def finish(self) -> None:
        self.server.connections.discard(self)
        super().finish()

    def handle_one_request(self) -> None:
        self._body: LimitedStream | None = None
        self._keep = False
        super().handle_one_request()

    def make_environ(self) -> dict:
        environ = super().make_environ()
        length = environ.get("CONTENT_LENGTH", "")
        if environ.get("wsgi.input_terminated"):  # a chunked body: werkzeug's dechunker on the socket, no keep-alive
            environ["wsgi.input"] = DechunkedInput(self._socket_in)  # (its rfile is the empty stand-in here)
            return environ
        try:
            size = int(length) if length else 0
        except ValueError:
            return environ
        if size < 0:
            return environ
        self._body = LimitedStream(self._socket_in, size)
        environ["wsgi.input"] = self._body
        environ["wsgi.input_terminated"] = True  # the stream ends at Content-Length by itself
        self._keep = not self.server.draining
        return environ

    def send_header(self, keyword: str, value: str) -> None:
        if keyword.lower() == "connection" and value.lower() == "close" and self._keep:
            body = self._body
            if not self.server.draining and (body is None or body.limit - body.tell() <= DRAIN_MAX):
                return  # werkzeug's "always close": this connection stays open
            self._keep = False
        super().send_header(keyword, value)

    def run_wsgi(self) -> None:
        # werkzeug reads ``self.rfile`` after the answer while ``self.connection`` is readable; that would be the
        # next request here. It gets an empty stream and an always-readable (EOF) descriptor instead.
        self._socket_in, self.rfile, real = self.rfile, io.BytesIO(), self.connection
        self.connection = self.server.eof_reader
        try:
            super().run_wsgi()
        finally:
            self.rfile, self.connection = self._socket_in, real
        body = self._body
        if self._keep and body is not None and not body.is_exhausted:
            try:
                body.exhaust()
            except Exception:  # the client went away mid-body
                self.close_connection = True
        if not self._keep:
            self.close_connection = True


class _EofReader:
    """A descriptor select() always finds readable (a pipe whose writer is closed), for werkzeug's post-answer
    drain, which then reads nothing."""

    def __init__(self) -> None:
        read, write = os.pipe()
        os.close(write)
        self.fd = read

    def fileno(self) -> int:
        return self.fd


class _InFlight:
    """Requests in flight, for draining."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)

    def enter(self) -> None:
        with self.lock:
            self.count += 1

    def leave(self) -> None:
        with self.lock:
            self.count -= 1
            if self.count == 0:
                self.idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self.lock:
            return self.idle.wait_for(lambda: self.count == 0, timeout)


def _close_idle(server) -> None:
    """Close the kept-alive connections with no request in flight: a caller's next request on one goes elsewhere."""
    for handler in list(server.connections):
        if not getattr(handler, "_counted", False):
            with contextlib.suppress(OSError):
                handler.connection.shutdown(socket.SHUT_RDWR)


def _watch_lifeline(fd: int) -> None:
    """Block on the KeysManager's lifeline pipe; EOF means every KeysManager copy of the write end closed."""
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os._exit(0)


def serve_forever(app, listen_fd: int, lifeline_fd: int | None, drain_timeout_s: float) -> None:
    """Serve ``app`` on the inherited listening socket ``listen_fd`` until SIGTERM (drain) or lifeline EOF."""
    with socket.socket(fileno=os.dup(listen_fd)) as probe:  # the family of the inherited socket (TCP or Unix)
        unix = probe.family == socket.AF_UNIX
        host = f"unix://{probe.getsockname()}" if unix else "127.0.0.1"
    server = ThreadedWSGIServer(host, 0, AccessLog(app), handler=_KeepAliveHandler, fd=listen_fd)
    server.in_flight, server.connections, server.draining, server.eof_reader = _InFlight(), set(), False, _EofReader()
    os.close(listen_fd)  # the server holds its own duplicate
    server.daemon_threads = True
    if lifeline_fd is not None:
        threading.Thread(target=_watch_lifeline, args=(lifeline_fd,), daemon=True, name="lifeline").start()

    def on_term(signum, frame) -> None:
        server.draining = True  # answers from now on close their connections
        threading.Thread(target=server.shutdown, daemon=True, name="drain").start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of a terminal reaches the KeysManager, which stops us
    try:
        # socketserver's loop, not werkzeug's: werkzeug's closes the socket on exit, dropping the backlog
        socketserver.BaseServer.serve_forever(server, poll_interval=0.05)
    finally:
        # answer the connections already waiting in the listen backlog, then stop accepting
        while select.select([server.socket], [], [], 0)[0]:
            server._handle_request_noblock()
        server.socket.close()  # from now on new connections are refused, not queued
        time.sleep(0.01)  # let the handler threads just started read their request lines
        _close_idle(server)
        server.in_flight.wait_idle(drain_timeout_s)
        os._exit(0)
