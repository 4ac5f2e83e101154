"""The client to replicas on plain aiohttp (``QUART_HTTP_CODEC=aiohttp``, :mod:`.codec`): the same calls,
answers and errors as the lean :class:`~.upstream.UpstreamPool`, through an :class:`aiohttp.ClientSession`.

What differs: aiohttp cannot tell a *fresh* connection reset before the first byte of the answer (a
replica killed a moment ago, the lean client's :class:`~.upstream.UpstreamRefused`) from a reset
mid-answer, so only a connection that could not be made is :class:`~.upstream.UpstreamRefused` here;
sockets are aiohttp's (no dead-peer keep-alive probes: a silent host fails at the call's timeout).
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
from multidict import CIMultiDict
from quart_transport.headers import HOP_BY_HOP
from quart_transport.upstream import (
    Piece,
    UpstreamError,
    UpstreamRefused,
    UpstreamResponse,
    UpstreamStream,
    UpstreamTimeout,
)

from keysmanager.aio import within

_SKIP = ("User-Agent", "Accept", "Accept-Encoding")  # the lean client sends none of them: neither does this


def _end_to_end(headers: Mapping[str, str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


def _failure(exc: BaseException, base_url: str, timeout_s: float) -> UpstreamError:
    """The :class:`UpstreamError` an aiohttp failure is."""
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"no answer within {timeout_s:g} s")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamRefused(f"cannot connect to {base_url}: {exc}")
    return UpstreamError(f"the replica's answer failed: {exc!r}")


class AiohttpUpstreamPool:
    """Keep-alive connections to replicas through one :class:`aiohttp.ClientSession` (made on first use)."""

    def __init__(self, timeout_s: float, keepalive_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self.session: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s, enable_cleanup_closed=True)
            self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                 cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=_SKIP)
        return self.session

    async def _open(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                    timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        if not base_url.startswith("http://"):
            raise UpstreamRefused(f"unsupported replica url {base_url!r} (http://host:port only)")
        data = body if body or method not in ("GET", "HEAD") else None
        # the body is whole here: an ``Expect: 100-continue`` passed on would make aiohttp wait for a 100 first
        sent = [(k, v) for k, v in headers.items() if k.lower() != "expect"]
        return await self._session().request(method, base_url.rstrip("/") + path, headers=sent,
                                             data=data, timeout=timeout, allow_redirects=False)

    async def request(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                      timeout_s: float | None = None) -> UpstreamResponse:
        """As :meth:`quart_transport.upstream.UpstreamPool.request`."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with await self._open(method, base_url, path, headers, body,
                                        aiohttp.ClientTimeout(total=timeout)) as res:
                payload = await res.read()
                return UpstreamResponse(res.status, _end_to_end(res.headers), payload)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failure(exc, base_url, timeout) from exc

    async def stream(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                     timeout_s: float | None = None, idle_s: float | None = None) -> UpstreamStream:
        """As :meth:`quart_transport.upstream.UpstreamPool.stream`."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        idle = timeout if idle_s is None else idle_s
        try:  # ``timeout`` bounds the wait for the head, ``idle`` each piece (UpstreamStream)
            res = await within(timeout, self._open(method, base_url, path, headers, body,
                                                   aiohttp.ClientTimeout(total=None)))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failure(exc, base_url, timeout) from exc

        async def next_piece() -> Piece:
            try:
                piece = await res.content.readany()
            except (TimeoutError, aiohttp.ClientError) as exc:
                return _failure(exc, base_url, idle)
            return piece or None

        def release(whole: bool) -> None:
            if whole:
                res.release()
            else:
                res.close()

        return UpstreamStream(res.status, _end_to_end(res.headers), next_piece, release, idle)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
