"""Which failed stage calls the router tries again on another replica (issue 14, item 5). Pure.

A retry helps only when another replica can succeed where this one did not:

- the replica never answered: connection refused or reset, the server closed the connection, the
  replica died mid-answer (``aiohttp`` connection and payload errors), the attempt timed out (a stopped
  or overloaded replica);
- the replica answered "not now": 408, 429, 502, 503 (its own overload or a draining replica).

Everything else is answered as it is, never retried: a 4xx is the request's fault and fails the same
everywhere; a 500 or another 5xx from a stage is its answer to this input (``stage compute failed``),
and retrying it three times only turned a precise error into a 502. The caller also never picks a
replica it already tried (``Job.tried``) or one the gateway knows dead (the ready lists leave them out).
"""

from __future__ import annotations

import aiohttp

RETRIABLE_STATUSES = frozenset({408, 429, 502, 503})
_NEVER_ANSWERED = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError, TimeoutError)


def should_retry(status: int, error: BaseException | None) -> bool:
    """Whether a failed call (``status`` of the replica's answer, or ``error`` when there was none) may be
    tried again on another replica."""
    if error is not None:  # a plain ClientError (the router's own client closed): no replica can help
        return isinstance(error, _NEVER_ANSWERED)
    return status in RETRIABLE_STATUSES


def replica_gone(error: BaseException | None) -> bool:
    """Whether the replica is known dead: nothing listens on its port any more (connection refused). The
    router then tells its replica source, so no request of any kind is sent there again (``pick`` only
    de-prioritizes replicas a request already tried: with the others busy it would pick the dead one)."""
    return isinstance(error, aiohttp.ClientConnectorError | ConnectionRefusedError)


def passed_on(status: int, error: BaseException | None) -> bool:
    """Whether the replica's own answer goes to the client as it is (a non-2xx that no retry can fix)."""
    return error is None and not 200 <= status < 300 and not should_retry(status, None)
