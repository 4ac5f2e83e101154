"""Bearer-token authentication of the KeysManager API on TCP (the Unix socket is guarded by its mode 0600).

A cluster shares one token: `quartctl up --network netns` writes it once to
``<state>/secrets/keysmanager-token`` (mode 0600). The TCP listener answers a request without
``Authorization: Bearer <token>`` with 401 JSON naming the cause; tokens are compared in constant time.
There is no TCP listener without a token.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from aiohttp import web
from quart_stage.errors import QuartError

MIN_TOKEN_CHARS = 16
HEADER = "Authorization"


def read_token(path: str | Path) -> str:
    """The token in ``path``; ValueError naming the cause when the file is missing, not private, or too short."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        token = p.read_text().strip()
    except OSError as exc:
        raise ValueError(f"token file {p}: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise ValueError(f"token file {p} has mode {mode & 0o777:04o}; it must be 0600 (readable by its owner only)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"token file {p} holds no token of at least {MIN_TOKEN_CHARS} characters")
    return token


def bearer_header(token: str) -> dict[str, str]:
    """The header a client sends."""
    return {HEADER: f"Bearer {token}"}


def unauthorized_cause(header: str | None, token: str) -> str | None:
    """Why ``header`` (an ``Authorization`` value) does not carry ``token``; None when it does."""
    if header is None:
        return "missing Authorization header: send 'Authorization: Bearer <token>' (the cluster's keysmanager-token)"
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return "the Authorization header is not 'Bearer <token>'"
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return "wrong bearer token"
    return None


def require_token(token: str):
    """aiohttp middleware: 401 JSON ``{"error": cause, "field": "Authorization"}`` unless the token matches."""

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        cause = unauthorized_cause(request.headers.get(HEADER), token)
        if cause is None:
            return await handler(request)
        error = QuartError(401, cause, HEADER)
        return web.json_response(error.to_json(), status=401, headers={"WWW-Authenticate": 'Bearer realm="keysmanager"'})

    return check
