"""Client sockets that notice a silent peer in about two seconds: a host whose link went down.

A host that loses its link refuses and resets nothing: a request already sent waits for an answer that
never comes, up to the caller's timeout (30 s for a stage call, minutes for a proxied one). With these
sockets, TCP keep-alive probes the peer after 1 s of silence and ``TCP_USER_TIMEOUT`` drops the
connection once data or a probe stays unacknowledged for 1.5 s, so the caller gets a connection error
after about 2 s and retries on another replica (the router) or answers 502 (the proxy). A healthy
host's kernel acknowledges the probes while its replica computes, so a long call is not cut short.
"""

from __future__ import annotations

import socket
from typing import Any

import aiohttp

KEEPALIVE_IDLE_S = 1  # silence before the first probe
KEEPALIVE_INTERVAL_S = 1  # between probes
KEEPALIVE_PROBES = 2
USER_TIMEOUT_MS = 1500  # unacknowledged data (or probes) for this long: the connection is dead


def dead_peer_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """A TCP socket for ``addr_info`` (family, type, proto, ...) with keep-alive and a user timeout."""
    family, type_, proto = addr_info[:3]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has all four
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
    return sock


def dead_peer_connector(**kwargs: Any) -> aiohttp.TCPConnector:
    """An aiohttp connector whose connections use :func:`dead_peer_socket`."""
    return aiohttp.TCPConnector(socket_factory=dead_peer_socket, **kwargs)
