"""The one retry rule of the data plane: which failed calls of a replica another replica may fix. Pure.

Both callers of replicas use it — the proxy (``/function/<fn>``, :mod:`.handlers_invoke`) and the
pipeline router (``gateway_plugin.router``), each through the lean client (:mod:`.upstream`):

- :func:`replica_gone`: the replica never saw the request (:class:`~.upstream.UpstreamRefused`, a
  refused connection): it is dead; the caller marks it unreachable and tries another one. Always safe.
- :func:`should_retry`: another replica may succeed — the replica never answered (gone, reset, timed
  out: a stopped or overloaded replica) or answered "not now" (408, 429, 502, 503: its own overload, a
  draining replica).
- :func:`passed_on`: everything else goes to the client as it is, never retried: a 4xx is the
  request's fault and fails the same everywhere; a 500 or another 5xx is the stage's answer to this
  input (``stage compute failed``).

A caller bounds the attempts: the proxy retries only a replica that is gone (a call of a deployed
function may not be idempotent, and the replica that timed out may still be running it; at most one
retry); the router retries whatever :func:`should_retry` allows while the request's deadline and
``max_attempts`` allow (a stage is a pure function of its input), never on a replica it already tried.
"""

from __future__ import annotations

from aiohttp import ClientConnectorError
from quart_transport.upstream import UpstreamError, UpstreamRefused

RETRIABLE_STATUSES = frozenset({408, 429, 502, 503})
_NEVER_ANSWERED = (UpstreamError, ConnectionError, TimeoutError)


def replica_gone(error: BaseException | None) -> bool:
    """Whether the replica is known dead: nothing listens on its port any more (connection refused), so no
    request of any kind is sent there again (``pick`` only de-prioritizes replicas a request already tried)."""
    if isinstance(error, ClientConnectorError):  # aiohttp's client (the session engine) wraps the refusal
        error = error.os_error
    return isinstance(error, UpstreamRefused | ConnectionRefusedError)


def should_retry(status: int, error: BaseException | None) -> bool:
    """Whether a failed call (``status`` of the replica's answer, or ``error`` when there was none) may be
    tried again on another replica."""
    if error is not None:  # anything else (the caller's own client closed): no replica can help
        return isinstance(error, _NEVER_ANSWERED)
    return status in RETRIABLE_STATUSES


def passed_on(status: int, error: BaseException | None) -> bool:
    """Whether the replica's own answer goes to the client as it is (a non-2xx that no retry can fix)."""
    return error is None and not 200 <= status < 300 and not should_retry(status, None)
