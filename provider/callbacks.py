"""Where an async call's result may be POSTed (``X-Callback-Url``), and the delivery of it.

A callback is a request the gateway makes on a caller's behalf, so it must not reach what the caller
could not: destinations are checked against a policy (:class:`CallbackPolicy`) when the call is
accepted (a 400 naming ``X-Callback-Url``) and again on every address the name resolves to when the
result is delivered (the resolver itself filters, so a name that re-resolves to a refused address
later, DNS rebinding, still cannot be reached). Refused unless allowed by
``callback_allowed_networks``: loopback, link-local, private (RFC 1918, ULA), shared (CGNAT),
multicast, reserved and unspecified addresses.

Delivery (:class:`CallbackSender`): no redirects followed (a 3xx is the destination's answer), one
timeout per callback (``callback_timeout_s``), and at most ``callback_per_destination`` callbacks in
flight to one ``host:port``: a slow destination queues its own callbacks, not anyone else's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

log = logging.getLogger("quart.gateway.callbacks")

CALLBACK_HEADER = "X-Callback-Url"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_networks(text: str) -> tuple[Network, ...]:
    """``"127.0.0.0/8, ::1"`` → networks; ValueError names the entry that is not one."""
    networks = []
    for item in (part.strip() for part in text.split(",")):
        if item:
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"callback_allowed_networks: {item!r} is not an address or CIDR network") from None
    return tuple(networks)


@dataclass(frozen=True, slots=True)
class CallbackPolicy:
    """Which addresses a callback may reach: public ones, plus ``allowed`` networks (e.g. loopback in tests)."""

    allowed: tuple[Network, ...] = ()

    @classmethod
    def from_text(cls, text: str) -> CallbackPolicy:
        return cls(parse_networks(text))

    def refusal(self, address: str) -> str | None:
        """Why ``address`` may not be called back (None: it may)."""
        ip: Address = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in net for net in self.allowed):
            return None
        for kind in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
            if getattr(ip, f"is_{kind}"):
                return (f"{address} is a {kind.replace('_', '-')} address; callbacks to it are refused unless "
                        "callback_allowed_networks (QUART_GATEWAY_CALLBACK_ALLOWED_NETWORKS) allows it")
        if not ip.is_global:
            return f"{address} is not a public address (allow it with callback_allowed_networks)"
        return None

    async def check_url(self, raw: str | None) -> str | None:
        """The ``X-Callback-Url`` header checked: an absolute http(s) URL whose host resolves only to addresses
        this policy allows; ValueError says what is wrong. None when no callback was asked for."""
        if raw is None or not raw.strip():
            return None
        url = raw.strip()
        try:
            parts = urlsplit(url)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            valid = False
        if not valid:
            raise ValueError(f"{CALLBACK_HEADER} must be an absolute http(s) URL, got {raw!r}")
        host = parts.hostname or ""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ValueError(f"{CALLBACK_HEADER}: cannot resolve {host!r}: {exc}") from None
        for info in infos:
            reason = self.refusal(str(info[4][0]))
            if reason is not None:
                raise ValueError(f"{CALLBACK_HEADER} {url!r}: {reason}")
        return url


class PolicyResolver(AbstractResolver):
    """aiohttp's resolver, keeping only addresses the policy allows (none left: the connection fails)."""

    def __init__(self, policy: CallbackPolicy) -> None:
        self.policy = policy
        self._inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        kept = [r for r in found if self.policy.refusal(r["host"]) is None]
        if not kept:
            raise OSError(f"callback host {host!r} resolves only to refused addresses "
                          f"({', '.join(r['host'] for r in found)})")
        return kept

    async def close(self) -> None:
        await self._inner.close()


@dataclass(slots=True)
class CallbackSender:
    """POSTs results to callback URLs under the policy; bounded per destination, one timeout per callback."""

    policy: CallbackPolicy
    timeout_s: float = 10.0
    per_destination: int = 4
    delivered: int = 0
    failed: int = 0
    _session: aiohttp.ClientSession | None = None
    _limits: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    _users: dict[str, int] = field(default_factory=dict)  # callbacks in flight or waiting, per destination

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(resolver=PolicyResolver(self.policy), limit=0, force_close=True)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def post(self, url: str, headers: Mapping[str, str], body: bytes) -> int | None:
        """Deliver one callback; its answer's status, or None when it could not be delivered (logged)."""
        parts = urlsplit(url)
        key = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        limit = self._limits.setdefault(key, asyncio.Semaphore(max(1, self.per_destination)))
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with limit:
                try:
                    kwargs: dict[str, Any] = dict(data=body, headers=dict(headers), allow_redirects=False,
                                                  timeout=aiohttp.ClientTimeout(total=self.timeout_s))
                    async with self._client().post(url, **kwargs) as res:
                        await res.read()
                        status = res.status
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    self.failed += 1
                    log.warning("callback to %s failed: %s: %s", url, type(exc).__name__, exc)
                    return None
        finally:
            self._users[key] -= 1
            if not self._users[key]:  # no callback to it in flight or waiting: forget the destination
                del self._users[key], self._limits[key]
        self.delivered += 1
        if status >= 300:
            log.warning("callback to %s answered %d (not followed, not retried)", url, status)
        return status

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
