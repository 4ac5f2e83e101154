"""``/system/secrets``: faas-cli's ``secret list|create|update|remove`` (``proxy/secret.go``), bodies
``types.Secret`` ``{"name", "namespace", "value" | "rawValue" (base64)}``.

Status codes: list 200 ``[{"name","namespace"}]`` (values are never returned); create 201 (spec), 409
when it exists (faas-cli reports the conflict); update 200, 404 unknown; remove 200 (the spec says
204, but faas-cli's ``RemoveSecret`` takes only 200/202 as success), 404 unknown; a namespace other
than the gateway's is a 404; a bad name or ``rawValue`` a 400 naming the field.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from aiohttp import web
from quart_provider.bodies import read_body
from quart_provider.deployment import parse_json_object
from quart_provider.gateway import EmbeddedGateway
from quart_provider.secrets import check_name
from quart_stage.errors import invalid
from quart_transport import namespaces


class SecretHandlers:
    """The secret handlers over one gateway's :class:`~quart_provider.secrets.SecretStore`."""

    def __init__(self, gateway: EmbeddedGateway) -> None:
        self.store = gateway.secrets
        self.config = gateway.config

    async def _secret(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        body = parse_json_object(await read_body(request, self.config.max_deploy_bytes))
        namespaces.check(body.get("namespace") or request.query.get("namespace"), self.config.namespace)
        return check_name(body.get("name")), body

    @staticmethod
    def _value(body: dict[str, Any]) -> bytes:
        """``rawValue`` (base64 bytes) when given, else ``value`` (text), as faas-provider's ``types.Secret``."""
        raw = body.get("rawValue")
        if raw:
            if not isinstance(raw, str):
                raise invalid("rawValue", "rawValue must be a base64 string")
            try:
                return base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError):
                raise invalid("rawValue", "rawValue is not valid base64") from None
        value = body.get("value") or ""
        if not isinstance(value, str):
            raise invalid("value", "value must be a string")
        return value.encode()

    async def list(self, request: web.Request) -> web.Response:
        namespaces.check(request.query.get("namespace"), self.config.namespace)
        return web.json_response([{"name": n, "namespace": self.store.namespace} for n in self.store.names()])

    async def create(self, request: web.Request) -> web.Response:
        name, body = await self._secret(request)
        self.store.create(name, self._value(body))
        return web.Response(status=201)

    async def update(self, request: web.Request) -> web.Response:
        name, body = await self._secret(request)
        self.store.update(name, self._value(body))
        return web.Response(status=200)

    async def delete(self, request: web.Request) -> web.Response:
        name, _ = await self._secret(request)
        self.store.delete(name)
        return web.Response(status=200)
