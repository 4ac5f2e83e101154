"""Handlers of the control plane: ``/system/*`` (faas-provider's deploy, update, delete, scale, read,
list, namespaces and info handlers), plus ``/healthz`` and ``/metrics``.

Request and response shapes follow faas-provider's types and what faas-cli sends (``proxy/`` in
openfaas/faas-cli): deploy is ``POST /system/functions`` (202), update ``PUT`` (200; 404 when the
function does not exist, after which faas-cli falls back to POST), delete ``DELETE`` with
``{"functionName"}`` (200), scale ``POST /system/scale-function/{name}`` with
``{"serviceName","replicas"}`` (202), describe ``GET /system/function/{name}``, list
``GET /system/functions`` (also faas-cli login's credential check). Bad input raises
:class:`~quart_stage.errors.QuartError`; :mod:`.routes` renders it.
"""

from __future__ import annotations

import json
import platform
from typing import Any

from aiohttp import web
from quart_kernel.capacity import status_fields
from quart_provider.bodies import read_body
from quart_provider.deployment import FunctionDeployment, parse_json_object
from quart_provider.gateway import EmbeddedGateway
from quart_provider.models import model_status, scale_model
from quart_provider.types import FunctionState
from quart_stage.errors import invalid
from quart_transport import namespaces

VERSION = "0.1.0"


class SystemHandlers:
    """The ``/system`` handlers over one gateway; ``provider``: answer as a faas-provider behind OpenFaaS."""

    def __init__(self, gateway: EmbeddedGateway, provider: bool = False) -> None:
        self.gateway = gateway
        self.config = gateway.config
        self.provider = provider

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        return parse_json_object(await read_body(request, self.config.max_deploy_bytes))

    def _check_namespace(self, namespace: str | None) -> None:
        namespaces.check(namespace, self.config.namespace)

    # ------------------------------------------------------------ internal endpoints

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.gateway.metrics.exposition(request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    # ------------------------------------------------------------ /system

    async def info(self, request: web.Request) -> web.Response:
        version = {"sha": self.gateway.config.git_sha, "release": VERSION}
        provider_info = {"provider": "quart-embedded", "orchestration": "keysmanager", "version": version}
        if self.provider:  # faas-provider's /system/info is a ProviderInfo; the gateway wraps it
            return web.json_response(provider_info)
        return web.json_response({
            "provider": provider_info,
            "version": {**version, "commit_message": "QUART-FaaS embedded gateway"},
            "arch": platform.machine(),
        })

    async def list_functions(self, request: web.Request) -> web.Response:
        self._check_namespace(request.query.get("namespace"))
        return web.json_response([self._status(fn) for fn in self.gateway.functions.values()])

    async def describe(self, request: web.Request) -> web.Response:
        self._check_namespace(request.query.get("namespace"))
        name = request.match_info["name"]
        if name not in self.gateway.functions and (model := model_status(self.gateway, name)) is not None:
            return web.json_response(model)  # a pipeline, as one function (an OpenFaaS gateway in front asks)
        return web.json_response(self._status(self.gateway.registry.get(name)))

    def _status(self, fn: FunctionState) -> dict[str, Any]:
        """A ``FunctionStatus`` plus ``status`` and, when not ready, the ``reason`` (:mod:`quart_kernel.capacity`)."""
        return {**fn.status_json(), **status_fields(fn, self.gateway.functions.values(), self.gateway.hosts)}

    async def deploy(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        await self.gateway.registry.deploy(FunctionDeployment.from_json(body, self.config.namespace))
        return web.Response(status=202)

    async def update(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        deployment = FunctionDeployment.from_json(body, self.config.namespace)
        await self.gateway.registry.update(deployment)
        return web.Response(status=200)

    async def delete(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        name = body.get("functionName")
        if not isinstance(name, str) or not name:
            raise invalid("functionName", "functionName is required")
        self._check_namespace(body.get("namespace") or request.query.get("namespace"))
        await self.gateway.registry.remove(name)
        return web.Response(status=200)

    async def scale(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = await self._json_body(request)
        replicas = body.get("replicas")
        if replicas is None:
            raise invalid("replicas", "replicas is required")
        if isinstance(replicas, bool) or not isinstance(replicas, int | float) or replicas != int(replicas):
            raise invalid("replicas", f"replicas must be an integer, got {json.dumps(replicas)}")
        if replicas < 0:
            raise invalid("replicas", f"replicas must not be negative, got {int(replicas)}")
        service = body.get("serviceName")
        if service not in (None, "", name):
            raise invalid("serviceName", f"serviceName {service!r} does not match the function in the path ({name!r})")
        self._check_namespace(body.get("namespace") or request.query.get("namespace"))
        key = body.get("key", False)
        if not isinstance(key, bool):
            raise invalid("key", f"key must be a boolean, got {json.dumps(key)}")
        if name not in self.gateway.functions and name in self.gateway.registry.pipelines():
            applied = await scale_model(self.gateway, name, int(replicas))
        else:
            applied = await self.gateway.registry.scale(name, int(replicas), key=key)
        return web.json_response({"serviceName": name, "replicas": applied}, status=202)

    async def namespaces(self, request: web.Request) -> web.Response:
        return web.json_response([self.config.namespace])

    async def namespace(self, request: web.Request) -> web.Response:
        """``GET /system/namespace/{name}``: a ``FunctionNamespace`` (faas-provider types); 404 for another."""
        name = request.match_info["name"]
        namespaces.check(name, self.config.namespace)
        return web.json_response({"name": name, "labels": {"openfaas": "1"}})

    async def replicas(self, request: web.Request) -> web.Response:
        """Extension: the replicas of a function, with host, state and in-flight requests."""
        fn = self.gateway.registry.get(request.match_info["name"])
        return web.json_response({"function": fn.name, "desired": fn.desired, "generation": fn.generation,
                                  "unplaced": fn.unplaced, "lastError": fn.last_error,
                                  "replicas": [e.to_json() for e in fn.replicas.values()]})
