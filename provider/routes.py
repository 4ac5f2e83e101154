"""Every route of the provider's HTTP API, wired in one place (faas-provider's ``serve.go``).

The OpenFaaS gateway REST API (``api-docs/spec.openapi.yml``) over an :class:`.gateway.EmbeddedGateway`:
``/system/*`` (:mod:`.handlers_system`, :mod:`.handlers_secrets`, :mod:`.handlers_logs`, :mod:`.handlers_alert`,
basic auth) and ``/function``, ``/async-function``
(:mod:`.handlers_invoke`, their answers stamped with :mod:`quart_transport.tracing` headers). A handler's :class:`~quart_stage.errors.QuartError` becomes JSON
``{"error": ..., "field": ...}`` with its status here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from quart_provider.front import FrontSite
from quart_provider.gateway import EmbeddedGateway
from quart_provider.handlers_alert import AlertHandler
from quart_provider.handlers_invoke import InvokeHandlers
from quart_provider.handlers_logs import LogHandlers
from quart_provider.handlers_secrets import SecretHandlers
from quart_provider.handlers_system import SystemHandlers
from quart_stage.errors import QuartError
from quart_transport.auth import Credentials
from quart_transport.codec import CodecSettings
from quart_transport.responses import error_of, error_response
from quart_transport.tracing import traced

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
INVOKE = web.AppKey("quart.invoke", InvokeHandlers)  # the app's invoke handlers, which the fast front calls too


@web.middleware
async def malformed_body(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A body the server cannot decode (a ``Content-Encoding: gzip`` that is not gzip, a broken chunked
    framing) is the client's error: 400 naming the header, never a 500 (issue 31, item 5)."""
    try:
        return await handler(request)
    except (HttpProcessingError, RequestPayloadError) as exc:
        cause = exc.__cause__ or exc
        field = "Content-Encoding" if isinstance(cause, ContentEncodingError) else "body"
        message = getattr(cause, "message", "") or str(cause) or type(cause).__name__
        return error_response(400, f"the request body cannot be read: {message.strip()}", field)


def create_app(gateway: EmbeddedGateway, credentials: Credentials | None, provider: bool = False
               ) -> web.Application:
    """The aiohttp application; starting it starts the gateway's reconcile loop, cleanup stops everything.

    ``provider=True``: the faas-provider flavour of the same API, for a real OpenFaaS gateway in front
    (``functions_provider_url``): ``/system/info`` answers a ``ProviderInfo``, and the app leaves the
    gateway's lifecycle to the main app.
    """
    app = web.Application(client_max_size=gateway.config.max_body_bytes, middlewares=[malformed_body])
    system = SystemHandlers(gateway, provider)
    invoke = app[INVOKE] = InvokeHandlers(gateway, provider)
    secrets = SecretHandlers(gateway)
    retry_after_s = gateway.config.retry_after_s

    def guarded(handler: Handler, auth: bool = True) -> Handler:
        """Basic auth (unless ``auth`` is False), and a :class:`QuartError` answered as JSON."""

        async def wrapped(request: web.Request) -> web.StreamResponse:
            if auth and credentials is not None and not credentials.check(request.headers.get("Authorization")):
                return error_response(401, "missing or wrong credentials: use basic auth (faas-cli login)",
                                      headers={"WWW-Authenticate": 'Basic realm="Restricted"'})
            try:
                return await handler(request)
            except QuartError as exc:
                return error_of(exc, retry_after_s)

        return wrapped

    r = app.router
    r.add_get("/healthz", system.healthz)
    r.add_get("/health", system.healthz)  # vLLM's path: what GuideLLM and the field's probes ask
    r.add_get("/metrics", system.metrics)
    r.add_get("/system/info", guarded(system.info))
    r.add_get("/system/functions", guarded(system.list_functions))
    r.add_post("/system/functions", guarded(system.deploy))
    r.add_put("/system/functions", guarded(system.update))
    r.add_delete("/system/functions", guarded(system.delete))
    r.add_get("/system/function/{name}", guarded(system.describe))
    r.add_post("/system/scale-function/{name}", guarded(system.scale))
    r.add_get("/system/namespaces", guarded(system.namespaces))
    r.add_get("/system/namespace/{name}", guarded(system.namespace))
    r.add_get("/system/replicas/{name}", guarded(system.replicas))
    r.add_get("/system/secrets", guarded(secrets.list))
    r.add_post("/system/secrets", guarded(secrets.create))
    r.add_put("/system/secrets", guarded(secrets.update))
    r.add_delete("/system/secrets", guarded(secrets.delete))
    r.add_get("/system/logs", guarded(LogHandlers(gateway).logs))
    r.add_post("/system/alert", guarded(AlertHandler(gateway).alert))

    async def ui(request: web.Request) -> web.StreamResponse:
        """The status page of the plugin (``gateway.ui_hook``); 404 without one."""
        if gateway.ui_hook is None:
            return error_response(404, "no status page here: the QUART plugin is not attached", None)
        if request.path == "/ui":
            raise web.HTTPFound("/ui/")
        return await gateway.ui_hook(request, request.match_info.get("tail", ""))

    r.add_get("/ui", guarded(ui))
    r.add_get("/ui/{tail:.*}", guarded(ui))
    async_invoke, sync_invoke = traced(guarded(invoke.async_invoke, auth=False)), traced(invoke.invoke)
    r.add_route("*", "/async-function/{name}", async_invoke)
    r.add_route("*", "/async-function/{name}/{tail:.*}", async_invoke)
    r.add_route("*", "/function/{name}", sync_invoke, expect_handler=invoke.expect)  # 100-continue: admit first
    r.add_route("*", "/function/{name}/{tail:.*}", sync_invoke, expect_handler=invoke.expect)

    async def api(request: web.Request) -> web.StreamResponse:
        """``/v1/...``: what an API hook answers (the plugin's OpenAI-compatible generation API)."""
        for hook in gateway.api_hooks:
            response = await hook(request)
            if response is not None:
                return response
        return error_response(404, f"nothing serves {request.path} (the gateway plugin is not attached)", "path")

    r.add_route("*", "/v1/{tail:.*}", traced(api))

    async def startup(app: web.Application) -> None:
        await invoke.startup()
        if not provider:
            await gateway.start()

    async def cleanup(app: web.Application) -> None:
        await invoke.stop_async_calls()
        if not provider:
            await gateway.close()
        await invoke.close()

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app


async def start_site(app: web.Application, bind: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving ``app``; returns the runner (``await runner.cleanup()`` to stop) and the bound port.

    An app of :func:`create_app` is served through the fast ``/function`` front (:mod:`.front`), which hands
    every other request to the app; with ``QUART_HTTP_CODEC=aiohttp`` (:mod:`quart_transport.codec`) aiohttp
    serves every request."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    invoke = app.get(INVOKE)
    site: web.TCPSite | FrontSite
    if invoke is not None and CodecSettings.from_env().lean:
        site = FrontSite(runner, invoke, bind, port, backlog=1024, reuse_address=True)
    else:
        site = web.TCPSite(runner, bind, port, backlog=1024, reuse_address=True)
    await site.start()
    return runner, site.port
