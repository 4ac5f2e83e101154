"""The KeysManager's HTTP API (JSON over the Unix socket): request validation, routes, errors as JSON."""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import TYPE_CHECKING, Any

from aiohttp import web

from keysmanager.types import FORK_MODES, START_SOURCES, StageSpec

if TYPE_CHECKING:
    from keysmanager.daemon import KeysManager

_FUNCTION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class ApiError(Exception):
    """An error answered to the API caller as ``{"error": ..., "field": ...}`` with an HTTP status."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


def build_app(km: KeysManager) -> web.Application:
    """The aiohttp application serving ``km``'s API under ``/v1/``."""
    app = web.Application(middlewares=[_errors_as_json], client_max_size=1 << 20)
    _Api(km).routes(app)
    return app


class _Api:
    def __init__(self, km: KeysManager) -> None:
        self.km = km

    def spec(self, body: Any, key: str = "spec") -> StageSpec:
        if not isinstance(body, dict) or not isinstance(body.get(key), dict):
            raise ApiError(400, f"the request body must be a JSON object with a {key!r} object", key)
        raw = body[key]
        function = raw.get("function")
        if not isinstance(function, str) or not _FUNCTION_RE.match(function):
            raise ApiError(400, "spec.function must be a name of letters, digits, '_', '.', '-'", "spec.function")
        env = raw.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ApiError(400, "spec.env must be an object of string values", "spec.env")
        cpus = raw.get("cpus", 1.0)
        if isinstance(cpus, bool) or not isinstance(cpus, int | float) or not 0 < cpus <= 1024:
            raise ApiError(400, "spec.cpus must be a number in (0, 1024]", "spec.cpus")
        for name in ("memory_bytes", "concurrency"):
            value = raw.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ApiError(400, f"spec.{name} must be a non-negative integer", f"spec.{name}")
        return StageSpec.from_dict(raw)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/health", self.h_health)
        app.router.add_post("/v1/cache", self.h_cache)
        app.router.add_post("/v1/replicas", self.h_start)
        app.router.add_get("/v1/replicas", self.h_replicas)
        app.router.add_post("/v1/replicas/{rid}/stop", self.h_stop)
        app.router.add_get("/v1/zygotes", self.h_zygotes)
        app.router.add_post("/v1/invalidate", self.h_invalidate)
        app.router.add_get("/v1/report", self.h_report)
        app.router.add_get("/v1/pins", self.h_pins)
        app.router.add_put("/v1/pins", self.h_set_pins)
        app.router.add_post("/v1/shutdown", self.h_shutdown)

    async def h_health(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.km.name, "pid": os.getpid(), "recovered": self.km.recovered})

    async def h_cache(self, request: web.Request) -> web.Response:
        spec = self.spec(await _json(request))
        z = await self.km.ensure_cached(spec)
        return web.json_response(self.km.zygote_info(z).to_dict())

    async def h_start(self, request: web.Request) -> web.Response:
        body = await _json(request)
        spec = self.spec(body)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ApiError(400, f"count must be a non-negative integer, got {count!r}", "count")
        if count > self.km.config.max_replicas_per_call:
            raise ApiError(400, f"count must be at most {self.km.config.max_replicas_per_call}", "count")
        mode = body.get("mode", self.km.config.fork_mode)
        if mode not in FORK_MODES:
            raise ApiError(400, f"mode must be one of {', '.join(FORK_MODES)}, got {mode!r}", "mode")
        flags = {}
        for name, default in (("survive", False), ("wait", True), ("cache", self.km.config.cache_on_cold)):
            flags[name] = body.get(name, default)
            if not isinstance(flags[name], bool):
                raise ApiError(400, f"{name} must be true or false", name)
        source = body.get("source", "auto")
        if source not in START_SOURCES:
            raise ApiError(400, f"source must be one of {', '.join(START_SOURCES)}, got {source!r}", "source")
        started = await self.km.start_replicas(spec, count, mode, **flags, cold=source == "cold")
        # no memory readings here: they are slow to take from a process that is still starting
        return web.json_response({"replicas": [self.km.replica_info(r, memory=False).to_dict() for r in started]})

    async def h_replicas(self, request: web.Request) -> web.Response:
        function = request.query.get("function")
        memory = request.query.get("memory", "1") not in {"0", "false"}  # PSS readings cost ~1 ms a replica
        reps = [r for r in self.km.replicas.values() if function is None or r.function == function]
        return web.json_response({"replicas": [self.km.replica_info(r, memory=memory).to_dict() for r in reps]})

    async def h_stop(self, request: web.Request) -> web.Response:
        body = await _json(request, allow_empty=True)
        drain = body.get("drain", True) if isinstance(body, dict) else True
        if not isinstance(drain, bool):
            raise ApiError(400, "drain must be true or false", "drain")
        rep = await self.km.stop(request.match_info["rid"], drain)
        return web.json_response(self.km.replica_info(rep).to_dict())

    async def h_zygotes(self, request: web.Request) -> web.Response:
        return web.json_response({"zygotes": [self.km.zygote_info(z).to_dict() for z in self.km.zygotes.values()
                                              if z.alive]})

    async def h_invalidate(self, request: web.Request) -> web.Response:
        body = await _json(request)
        function = body.get("function") if isinstance(body, dict) else None
        if not isinstance(function, str) or not _FUNCTION_RE.match(function):
            raise ApiError(400, "the body must be {\"function\": <stage function name>}", "function")
        dropped = await self.km.invalidate(function)
        return web.json_response({"function": function, "dropped": dropped})

    async def h_pins(self, request: web.Request) -> web.Response:
        return web.json_response({"pinned": sorted(self.km.pinned)})

    async def h_set_pins(self, request: web.Request) -> web.Response:
        """Replace the pinned stages: ``{"functions": [...]}`` (the scheduler's keep_cached for this host)."""
        body = await _json(request)
        functions = body.get("functions") if isinstance(body, dict) else None
        if not isinstance(functions, list) or not all(isinstance(f, str) and _FUNCTION_RE.match(f) for f in functions):
            raise ApiError(400, "the body must be {\"functions\": [<stage function name>, ...]}", "functions")
        if len(functions) > 4096:
            raise ApiError(400, "at most 4096 pinned functions", "functions")
        return web.json_response({"pinned": self.km.pin(functions)})

    async def h_report(self, request: web.Request) -> web.Response:
        return web.json_response(self.km.report().to_dict())

    async def h_shutdown(self, request: web.Request) -> web.Response:
        asyncio.get_running_loop().call_later(0.05, self.km.request_stop)
        return web.json_response({"stopping": True})


async def _json(request: web.Request, allow_empty: bool = False) -> Any:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise ApiError(400, "the request body is empty; expected a JSON object", "body")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", "body") from None


@web.middleware
async def _errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response({"error": exc.message, "field": exc.field}, status=exc.status)
    except web.HTTPException as exc:
        return web.json_response({"error": exc.reason, "field": None}, status=exc.status)
    except Exception as exc:  # a bug must not take the daemon down; answer it
        return web.json_response({"error": f"internal error: {type(exc).__name__}: {exc}", "field": None},
                                 status=500)


