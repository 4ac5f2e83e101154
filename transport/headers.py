"""HTTP headers a proxy forwards: everything but the hop-by-hop ones (RFC 9110 §7.6.1) and those it rewrites."""

from __future__ import annotations

from collections.abc import Iterable

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})


def forwardable(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The end-to-end headers of ``headers.items()``, to pass on to the next hop."""
    return {k: v for k, v in headers if k.lower() not in HOP_BY_HOP}
