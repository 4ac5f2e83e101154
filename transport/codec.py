"""Which HTTP/1.1 code a gateway hop runs: the lean hand-written codecs (the default) or plain aiohttp.

The hot path has two hand-written HTTP/1.1 codecs: the embedded gateway's ``/function`` front
(``quart_provider.front``, a server) and the client to replicas (:mod:`.upstream` over :mod:`.http1`). Both
are fenced by a conformance and fuzz suite against h11 (tests/unit/test_http1_conformance.py); this setting is
the way out if one of them misbehaves in the field: ``QUART_HTTP_CODEC=aiohttp`` serves ``/function`` with
aiohttp's server (its own handlers) and calls replicas through an :class:`aiohttp.ClientSession`
(:mod:`.upstream_aiohttp`), for the embedded gateway and the gateway plugin's router alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from quart_stage.settings import ConfigError, settings_from_env
from quart_transport.upstream import Upstream, UpstreamPool
from quart_transport.upstream_aiohttp import AiohttpUpstreamPool

CODECS = ("lean", "aiohttp")


@dataclass(frozen=True, slots=True)
class CodecSettings:
    """``QUART_HTTP_CODEC``: ``lean`` (default) or ``aiohttp``."""

    http_codec: str = "lean"

    def __post_init__(self) -> None:
        if self.http_codec not in CODECS:
            raise ConfigError(f"QUART_HTTP_CODEC must be one of {', '.join(CODECS)}, got {self.http_codec!r}")

    @property
    def lean(self) -> bool:
        return self.http_codec == "lean"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CodecSettings:
        return settings_from_env(cls, "QUART_", env)


def upstream_pool(timeout_s: float, keepalive_s: float = 60.0, codec: CodecSettings | None = None) -> Upstream:
    """The client to replicas ``codec`` (default: the environment's) names."""
    codec = CodecSettings.from_env() if codec is None else codec
    if codec.lean:
        return UpstreamPool(timeout_s, keepalive_s=keepalive_s)
    return AiohttpUpstreamPool(timeout_s, keepalive_s=keepalive_s)
