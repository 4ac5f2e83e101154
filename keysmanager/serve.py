"""A replica's HTTP server: the stage's WSGI app on a listening socket the parent already bound.

Runs in the replica (a forked child of a zygote, or a cold process). Threads are created here, after the
fork, never before. The server answers concurrent requests on threads (HTTP/1.1 keep-alive), writes one
access line per request to stderr, the replica's log (``quart_stage.logs.AccessLog``; no logging handler is
inherited across fork), stops accepting on SIGTERM and exits once the
requests in flight are answered (drain), and exits at once when the KeysManager's lifeline pipe closes.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import socketserver
import threading
import time
from typing import Any

from quart_stage.logs import AccessLog
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler


class _QuietHandler(WSGIRequestHandler):
    """No werkzeug request lines (AccessLog writes ours); counts a request as in flight from its request line to its response's end
    (an idle keep-alive connection is not in flight, so it does not hold a drain up)."""

    def handle_one_request(self) -> None:
        self._counted = False
        try:
            super().handle_one_request()
        finally:
            if self._counted:
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
    server = ThreadedWSGIServer(host, 0, AccessLog(app), handler=_QuietHandler, fd=listen_fd)
    server.in_flight = _InFlight()
    os.close(listen_fd)  # the server holds its own duplicate
    server.daemon_threads = True
    if lifeline_fd is not None:
        threading.Thread(target=_watch_lifeline, args=(lifeline_fd,), daemon=True, name="lifeline").start()

    def on_term(signum, frame) -> None:
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
        server.in_flight.wait_idle(drain_timeout_s)
        os._exit(0)
