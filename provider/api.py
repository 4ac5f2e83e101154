"""The OpenFaaS gateway REST API (``api-docs/spec.openapi.yml``) over an :class:`EmbeddedGateway`.

Request and response shapes follow faas-provider's types and what faas-cli sends (``proxy/`` in
openfaas/faas-cli): deploy is ``POST /system/functions`` (202), update ``PUT`` (200; 404 when the
function does not exist, after which faas-cli falls back to POST), delete ``DELETE`` with
``{"functionName"}`` (200), scale ``POST /system/scale-function/{name}`` with
``{"serviceName","replicas"}`` (202), describe ``GET /system/function/{name}``, list
``GET /system/functions`` (also faas-cli login's credential check). ``/system/*`` needs basic auth.
Client errors are JSON ``{"error": ..., "field": ...}``.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import time
from typing import Any

import aiohttp
from aiohttp import web
from quart_provider.async_calls import CALLBACK_HEADER, AsyncCall, AsyncInvoker, parse_callback
from quart_provider.auth import Credentials
from quart_provider.balancer import ServiceUnavailable
from quart_provider.deployment import FunctionDeployment, RequestError, bad, parse_json_object
from quart_provider.gateway import EmbeddedGateway
from quart_provider.headers import forwardable

VERSION = "0.1.0"
GATEWAY_KEY = web.AppKey("gateway", EmbeddedGateway)


def error_response(status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None
                   ) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    return web.json_response(body, status=status, headers=headers)


def _request_error(exc: RequestError, retry_after: int) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if exc.status in (429, 503) else None
    return error_response(exc.status, exc.message, exc.field, headers)


class GatewayAPI:
    """The handlers; one instance per app."""

    def __init__(self, gateway: EmbeddedGateway, credentials: Credentials | None, provider: bool = False) -> None:
        self.gateway = gateway
        self.provider = provider  # serve as a faas-provider behind a real OpenFaaS gateway
        self.config = gateway.config
        self.credentials = credentials
        self.session: aiohttp.ClientSession | None = None
        self._call_ids = itertools.count(1)
        self._call_prefix = f"{os.getpid():x}{int(time.time()):x}"
        self.async_calls = AsyncInvoker(self.config.async_workers, self.config.async_queue_cap,
                                        self.config.async_timeout_s)
        if not provider:  # one registration per gateway (the provider app shares the gateway's registry)
            gateway.metrics.registry.register(self.async_calls)

    # ------------------------------------------------------------ app wiring

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/system/info", self.system(self.info))
        r.add_get("/system/functions", self.system(self.list_functions))
        r.add_post("/system/functions", self.system(self.deploy))
        r.add_put("/system/functions", self.system(self.update))
        r.add_delete("/system/functions", self.system(self.delete))
        r.add_get("/system/function/{name}", self.system(self.describe))
        r.add_post("/system/scale-function/{name}", self.system(self.scale))
        r.add_get("/system/namespaces", self.system(self.namespaces))
        r.add_get("/system/replicas/{name}", self.system(self.replicas))
        r.add_route("*", "/async-function/{name}", self.system(self.async_invoke, auth=False))
        r.add_route("*", "/async-function/{name}/{tail:.*}", self.system(self.async_invoke, auth=False))
        r.add_route("*", "/function/{name}", self.invoke)
        r.add_route("*", "/function/{name}/{tail:.*}", self.invoke)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)

    async def _startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=None)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=self.config.upstream_timeout_s), skip_auto_headers=("User-Agent",),
        )
        if not self.provider:
            await self.gateway.start()

    async def _cleanup(self, app: web.Application) -> None:
        await self.async_calls.close(drain_s=min(5.0, self.config.drain_timeout_s))
        if not self.provider:
            await self.gateway.close()
        if self.session is not None:
            await self.session.close()

    def system(self, handler, auth: bool = True):
        """Wrap a /system handler: basic auth, JSON errors for :class:`RequestError`."""

        async def wrapped(request: web.Request) -> web.StreamResponse:
            if auth and self.credentials is not None and not self.credentials.check(request.headers.get("Authorization")):
                return error_response(401, "missing or wrong credentials: use basic auth (faas-cli login)",
                                      headers={"WWW-Authenticate": 'Basic realm="Restricted"'})
            try:
                return await handler(request)
            except RequestError as exc:
                return _request_error(exc, self.config.retry_after_s)

        return wrapped

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        limit = self.config.max_deploy_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(413, f"request body of {request.content_length} bytes is over the {limit}-byte limit",
                               "body")
        raw = await request.content.read(limit + 1)
        if len(raw) > limit:
            raise RequestError(413, f"request body is over the {limit}-byte limit", "body")
        return parse_json_object(raw)

    def _new_call_id(self) -> str:
        """An ``X-Call-Id`` unique to this gateway process."""
        return f"{self._call_prefix}-{next(self._call_ids)}"

    async def _invocation_body(self, request: web.Request) -> bytes:
        """The body of a /function or /async-function call; 413 over ``max_body_bytes``."""
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(413, f"request body of {request.content_length} bytes is over the {limit}-byte limit",
                               "body")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, f"request body is over the {limit}-byte limit", "body") from None

    def _check_namespace(self, namespace: str | None) -> None:
        if namespace and namespace != self.config.namespace:
            raise bad(f"namespace {namespace!r} does not exist; this gateway has {self.config.namespace!r}",
                      "namespace")

    # ------------------------------------------------------------ internal endpoints

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.gateway.metrics.render(), content_type="text/plain", charset="utf-8")

    # ------------------------------------------------------------ /system

    async def info(self, request: web.Request) -> web.Response:
        version = {"sha": os.environ.get("QUART_GIT_SHA", "unknown"), "release": VERSION}
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
        return web.json_response([fn.status_json() for fn in self.gateway.functions.values()])

    async def describe(self, request: web.Request) -> web.Response:
        self._check_namespace(request.query.get("namespace"))
        return web.json_response(self.gateway.get(request.match_info["name"]).status_json())

    async def deploy(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        await self.gateway.deploy(FunctionDeployment.from_json(body, self.config.namespace))
        return web.Response(status=202)

    async def update(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        deployment = FunctionDeployment.from_json(body, self.config.namespace)
        await self.gateway.update(deployment)
        return web.Response(status=200)

    async def delete(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        name = body.get("functionName")
        if not isinstance(name, str) or not name:
            raise bad("functionName is required", "functionName")
        self._check_namespace(body.get("namespace") or request.query.get("namespace"))
        await self.gateway.remove(name)
        return web.Response(status=200)

    async def scale(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = await self._json_body(request)
        replicas = body.get("replicas")
        if replicas is None:
            raise bad("replicas is required", "replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int | float) or replicas != int(replicas):
            raise bad(f"replicas must be an integer, got {json.dumps(replicas)}", "replicas")
        if replicas < 0:
            raise bad(f"replicas must not be negative, got {int(replicas)}", "replicas")
        service = body.get("serviceName")
        if service not in (None, "", name):
            raise bad(f"serviceName {service!r} does not match the function in the path ({name!r})", "serviceName")
        self._check_namespace(body.get("namespace") or request.query.get("namespace"))
        key = body.get("key", False)
        if not isinstance(key, bool):
            raise bad(f"key must be a boolean, got {json.dumps(key)}", "key")
        applied = await self.gateway.scale(name, int(replicas), key=key)
        return web.json_response({"serviceName": name, "replicas": applied}, status=202)

    async def namespaces(self, request: web.Request) -> web.Response:
        return web.json_response([self.config.namespace])

    async def replicas(self, request: web.Request) -> web.Response:
        """Extension: the replicas of a function, with host, state and in-flight requests."""
        fn = self.gateway.get(request.match_info["name"])
        return web.json_response({"function": fn.name, "desired": fn.desired, "generation": fn.generation,
                                  "unplaced": fn.unplaced, "lastError": fn.last_error,
                                  "replicas": [e.to_json() for e in fn.replicas.values()]})

    async def async_invoke(self, request: web.Request) -> web.Response:
        """``POST /async-function/{name}``: 202 + ``X-Call-Id`` now, the call later (see :mod:`.async_calls`)."""
        if request.method != "POST":
            return error_response(405, f"asynchronous invocation takes POST, not {request.method}", "method",
                                  headers={"Allow": "POST"})
        name = request.match_info["name"]
        base, _, namespace = name.partition(".")
        if namespace and namespace != self.config.namespace:
            return error_response(404, f"namespace {namespace!r} does not exist", "namespace")
        if base not in self.gateway.functions and base not in self.gateway.pipelines():
            return error_response(404, f"function {base!r} not found", "functionName")
        try:
            callback = parse_callback(request.headers.get(CALLBACK_HEADER))
        except ValueError as exc:
            return error_response(400, str(exc), CALLBACK_HEADER)
        body = await self._invocation_body(request)
        host, port = request.transport.get_extra_info("sockname")[:2]  # this listener: the worker calls back in
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{port}/function/{request.raw_path.split('/async-function/', 1)[1]}"  # path, query as sent
        call_id = self._new_call_id()
        headers = {k: v for k, v in forwardable(request.headers.items()).items() if k.lower() != CALLBACK_HEADER.lower()}
        headers["X-Call-Id"] = call_id
        if not self.async_calls.submit(AsyncCall(call_id, name, url, headers, body, callback)):
            if self.async_calls.closed:
                return error_response(503, "the gateway is stopping", None,
                                      headers={"Retry-After": str(self.config.retry_after_s)})
            return error_response(429, f"the async queue is full ({self.async_calls.capacity} calls wait); retry "
                                       "later", None, headers={"Retry-After": str(self.config.retry_after_s)})
        return web.Response(status=202, headers={"X-Call-Id": call_id})

    # ------------------------------------------------------------ /function (the proxy)

    async def invoke(self, request: web.Request) -> web.StreamResponse:
        gateway = self.gateway
        name = request.match_info["name"]
        if "." in name:
            name, _, namespace = name.partition(".")
            if namespace != self.config.namespace:
                return error_response(404, f"namespace {namespace!r} does not exist", "namespace")
        fn = gateway.functions.get(name)
        tail = request.match_info.get("tail", "")
        if fn is None:
            for hook in gateway.invoke_hooks:
                response = await hook(request, name, tail)
                if response is not None:
                    return response
            return error_response(404, f"function {name!r} not found", "functionName")
        try:
            body = await self._invocation_body(request)
        except RequestError as exc:
            return _request_error(exc, self.config.retry_after_s)
        metrics, metric_name = gateway.metrics, fn.metric_name
        metrics.invocation_started(metric_name)
        start = time.perf_counter()
        call_id = self._new_call_id()
        headers = forwardable(request.headers.items())
        headers["X-Call-Id"] = call_id
        headers["X-Forwarded-Host"] = request.host
        path = f"/{tail}?{request.query_string}" if request.query_string else f"/{tail}"
        payload = None
        for attempt in range(2):  # a replica that refuses the connection never saw the request: try another
            try:
                endpoint = await gateway.acquire(fn)
            except ServiceUnavailable as exc:
                metrics.invocation_done(metric_name, exc.status, time.perf_counter() - start)
                return _request_error(exc, self.config.retry_after_s)
            try:
                async with self.session.request(request.method, endpoint.url + path, data=body,
                                                headers=headers) as upstream:
                    payload = await upstream.read()
                    status = upstream.status
                    out_headers = forwardable(upstream.headers.items())
                break
            except aiohttp.ClientConnectorError as exc:
                gateway.mark_unreachable(fn, endpoint)
                status, message = 502, f"replica {endpoint.id} of {name!r} refused the connection: {exc}"
                if attempt == 1:
                    break  # else: the next acquire waits (bounded) for another ready replica
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, message = 502, f"replica {endpoint.id} of {name!r} failed: {exc.__class__.__name__}: {exc}"
                break
            finally:
                gateway.release(fn, endpoint)
        fn.invocations += 1
        elapsed = time.perf_counter() - start
        metrics.invocation_done(metric_name, status, elapsed)
        if payload is None:
            return error_response(502, message)
        out_headers["X-Call-Id"] = call_id
        out_headers["X-Duration-Seconds"] = f"{elapsed:.6f}"
        return web.Response(status=status, body=payload, headers=out_headers)


def create_app(gateway: EmbeddedGateway, credentials: Credentials | None, provider: bool = False
               ) -> web.Application:
    """The aiohttp application; starting it starts the gateway's reconcile loop, cleanup stops everything.

    ``provider=True``: the faas-provider flavour of the same API, for a real OpenFaaS gateway in front
    (``functions_provider_url``): ``/system/info`` answers a ``ProviderInfo``, and the app leaves the
    gateway's lifecycle to the main app.
    """
    app = web.Application(client_max_size=gateway.config.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    GatewayAPI(gateway, credentials, provider).routes(app)
    return app


async def start_site(app: web.Application, bind: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving ``app``; returns the runner (``await runner.cleanup()`` to stop) and the bound port."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, bind, port, backlog=1024, reuse_address=True)
    await site.start()
    sockets = site._server.sockets if site._server else []  # noqa: SLF001 - aiohttp exposes no public getter
    return runner, sockets[0].getsockname()[1] if sockets else port
