"""The KeysManager's HTTP API (JSON on the Unix socket, and on TCP with a bearer token): request
validation, routes, errors as JSON.

Every error is answered as ``quart_stage.errors.QuartError`` renders it; the core's domain errors
(``keysmanager.errors``) get their HTTP status here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from typing import TYPE_CHECKING, Any

from aiohttp import web
from quart_stage import jsonparse
from quart_stage.errors import QuartError, invalid

from keysmanager.auth import require_token
from keysmanager.errors import (
    InvalidSpec,
    ManagerError,
    NoFreeSlot,
    NoRoom,
    NotFound,
    RegistryUnavailable,
    StartFailed,
)
from keysmanager.peers import serve_file
from keysmanager.starts import carry_out
from keysmanager.types import FORK_MODES, LISTEN_KINDS, START_MODES, START_SOURCES, StageSpec, StartOrder

if TYPE_CHECKING:
    from keysmanager.manager import KeysManager

_FUNCTION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_PEER_RE = re.compile(r"^http://[A-Za-z0-9.:\[\]-]+:\d{1,5}$")


_STATUS: dict[type[ManagerError], int] = {NotFound: 404, InvalidSpec: 400, NoFreeSlot: 409, NoRoom: 507,
                                          StartFailed: 500, RegistryUnavailable: 502}


def build_app(km: KeysManager, token: str | None = None) -> web.Application:
    """The aiohttp application serving ``km``'s API under ``/v1/``; with ``token``, only to requests that
    carry it (``keysmanager.auth``: the TCP listener)."""
    middlewares = [require_token(token)] if token is not None else []
    app = web.Application(middlewares=[*middlewares, _errors_as_json], client_max_size=1 << 20)
    _Api(km).routes(app)
    return app


class _Api:
    def __init__(self, km: KeysManager) -> None:
        self.km = km

    def spec(self, body: Any, key: str = "spec") -> StageSpec:
        if not isinstance(body, dict) or not isinstance(body.get(key), dict):
            raise invalid(key, f"the request body must be a JSON object with a {key!r} object")
        raw = body[key]
        function = raw.get("function")
        if not isinstance(function, str) or not _FUNCTION_RE.match(function):
            raise invalid("spec.function", "spec.function must be a name of letters, digits, '_', '.', '-'")
        env = raw.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise invalid("spec.env", "spec.env must be an object of string values")
        _check_cpus(raw.get("cpus", 1.0), "spec.cpus")
        for name in ("memory_bytes", "concurrency"):
            value = raw.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise invalid(f"spec.{name}", f"spec.{name} must be a non-negative integer")
        return StageSpec.from_dict(raw)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/health", self.h_health)
        app.router.add_post("/v1/cache", self.h_cache)
        app.router.add_post("/v1/attach", self.h_attach)
        app.router.add_post("/v1/starts", self.h_planned_start)
        app.router.add_post("/v1/replicas", self.h_start)
        app.router.add_get("/v1/replicas", self.h_replicas)
        app.router.add_post("/v1/replicas/{rid}/stop", self.h_stop)
        app.router.add_post("/v1/replicas/{rid}/cpus", self.h_resize)
        app.router.add_post("/v1/replicas/{rid}/lease", self.h_lease)
        app.router.add_get("/v1/zygotes", self.h_zygotes)
        app.router.add_post("/v1/invalidate", self.h_invalidate)
        app.router.add_get("/v1/report", self.h_report)
        app.router.add_get("/v1/pins", self.h_pins)
        app.router.add_put("/v1/pins", self.h_set_pins)
        app.router.add_post("/v1/shutdown", self.h_shutdown)
        app.router.add_post("/v1/prefetch", self.h_prefetch)
        app.router.add_get("/v1/stages/{function}", self.h_stage)
        app.router.add_get("/v1/stages/{function}/file", self.h_stage_file)

    async def h_health(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.km.name, "pid": os.getpid(), "recovered": self.km.recovered,
                                  "preloader": self.km.zygotes.preloader_state(),
                                  "landing": self.km.landing.summary()})

    async def h_cache(self, request: web.Request) -> web.Response:
        body = await _json(request)
        spec = self.spec(body)
        z = await self.km.ensure_cached(spec, peers=_peers(body))
        return web.json_response(self.km.zygote_info(z).to_dict())

    async def h_attach(self, request: web.Request) -> web.Response:
        """Cache the stage, answer its segment (path + tensor index) and manifest: a stage pod maps it itself
        (``quart_stage.attach``)."""
        spec = self.spec(await _json(request))
        return web.json_response(self.km.attach_info(await self.km.ensure_cached(spec)))

    async def h_planned_start(self, request: web.Request) -> web.Response:
        """One planned start, carried out whole (``keysmanager.starts``): ``{"spec": ..., "plan": StartOrder}``
        answers a ``StartReport``."""
        body = await _json(request)
        spec = self.spec(body)
        plan = body.get("plan")
        if not isinstance(plan, dict):
            raise invalid("plan", "the request body must have a 'plan' object (mode, peers, layers, cache, count)")
        unknown = sorted(set(plan) - {"mode", "peers", "layers", "cache", "count"})
        if unknown:
            raise invalid(f"plan.{unknown[0]}", f"plan.{unknown[0]} is not a field of a start plan")
        mode = plan.get("mode")
        if mode not in START_MODES:
            raise invalid("plan.mode", f"plan.mode must be one of {', '.join(START_MODES)}, got {mode!r}")
        cache = plan.get("cache", True)
        if not isinstance(cache, bool):
            raise invalid("plan.cache", "plan.cache must be true or false")
        order = StartOrder(mode, tuple(_peers(plan, "plan.peers")), _layers(plan, "plan.layers"), cache,
                           self.count(plan, "plan.count"))
        return web.json_response((await carry_out(self.km, spec, order)).to_dict())

    def count(self, body: dict, field: str = "count") -> int:
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise invalid(field, f"{field} must be a non-negative integer, got {count!r}")
        if count > self.km.config.max_replicas_per_call:
            raise invalid(field, f"{field} must be at most {self.km.config.max_replicas_per_call}")
        return count

    async def h_start(self, request: web.Request) -> web.Response:
        body = await _json(request)
        spec = self.spec(body)
        count = self.count(body)
        mode = body.get("mode", self.km.config.fork_mode)
        if mode not in FORK_MODES:
            raise invalid("mode", f"mode must be one of {', '.join(FORK_MODES)}, got {mode!r}")
        flags = {}
        for name, default in (("survive", False), ("wait", True), ("cache", self.km.config.cache_on_cold),
                              ("live", False)):
            flags[name] = body.get(name, default)
            if not isinstance(flags[name], bool):
                raise invalid(name, f"{name} must be true or false")
        source = body.get("source", "auto")
        if source not in START_SOURCES:
            raise invalid("source", f"source must be one of {', '.join(START_SOURCES)}, got {source!r}")
        listen = body.get("listen", "tcp")
        if listen not in LISTEN_KINDS:
            raise invalid("listen", f"listen must be one of {', '.join(LISTEN_KINDS)}, got {listen!r}")
        lease_within = body.get("lease_within_s")
        if lease_within is not None and (isinstance(lease_within, bool) or not isinstance(lease_within, int | float)
                                         or not 0 < lease_within <= 600):
            raise invalid("lease_within_s", "lease_within_s must be a number of seconds in (0, 600]")
        started = await self.km.start_replicas(spec, count, mode, **flags, cold=source == "cold", peers=_peers(body),
                                               unix=listen == "unix", layers=_layers(body))
        for rep in started if lease_within is not None else ():  # no lease by then: its holder is gone, stop it
            self.km.spawn_task(self._stop_unleased(rep.id, float(lease_within)))
        # no memory readings here: they are slow to take from a process that is still starting
        return web.json_response({"replicas": [self.km.replica_info(r, memory=False).to_dict() for r in started]})

    async def h_replicas(self, request: web.Request) -> web.Response:
        function = request.query.get("function")
        memory = request.query.get("memory", "1") not in {"0", "false"}  # PSS readings cost ~1 ms a replica
        return web.json_response({"replicas": [i.to_dict() for i in self.km.replica_infos(function, memory)]})

    async def h_stop(self, request: web.Request) -> web.Response:
        body = await _json(request, allow_empty=True)
        drain = body.get("drain", True) if isinstance(body, dict) else True
        if not isinstance(drain, bool):
            raise invalid("drain", "drain must be true or false")
        rep = await self.km.stop(request.match_info["rid"], drain)
        return web.json_response(self.km.replica_info(rep).to_dict())

    async def h_resize(self, request: web.Request) -> web.Response:
        """An in-place CPU change of one replica (``{"cpus": c}``): its threads get ⌈c⌉ cores."""
        body = await _json(request)
        cpus = body.get("cpus") if isinstance(body, dict) else None
        _check_cpus(cpus, "cpus")
        rep = self.km.resize(request.match_info["rid"], float(cpus))
        return web.json_response(self.km.replica_info(rep, memory=False).to_dict())

    async def _stop_unleased(self, rid: str, within_s: float) -> None:
        await asyncio.sleep(within_s)
        rep = self.km.replicas.by_id.get(rid)
        if rep is not None and not rep.leased and rep.state != "dead":
            await self.km.stop(rid, True)

    async def h_lease(self, request: web.Request) -> web.Response:
        """Tie a replica's life to this request: a chunked body its holder (a stage pod's forwarder,
        ``quart_stage.forward``) never ends while it lives. When the body ends or the connection drops (the
        holder exited, even by SIGKILL: the kernel closes its socket), the replica is stopped (drained). When
        the replica ends first, the answer (its info, state dead) tells the holder."""
        rid = request.match_info["rid"]
        rep = self.km.replicas.by_id.get(rid)
        if rep is None or rep.state == "dead":
            raise NotFound(f"no live replica with id {rid!r}", "replica_id")
        rep.leased = True
        holder = asyncio.ensure_future(_until_body_ends(request))
        died = asyncio.ensure_future(rep.died.wait())
        try:
            await asyncio.wait({holder, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not died.done():  # the holder is gone (or this handler was cancelled): stop the replica
                self.km.spawn_task(self.km.stop(rid, True))
            holder.cancel()
            died.cancel()
        return web.json_response(self.km.replica_info(rep, memory=False).to_dict())

    async def h_zygotes(self, request: web.Request) -> web.Response:
        return web.json_response({"zygotes": [i.to_dict() for i in self.km.zygote_infos()]})

    async def h_invalidate(self, request: web.Request) -> web.Response:
        body = await _json(request)
        function = body.get("function") if isinstance(body, dict) else None
        if not isinstance(function, str) or not _FUNCTION_RE.match(function):
            raise invalid("function", "the body must be {\"function\": <stage function name>}")
        dropped = await self.km.invalidate(function)
        return web.json_response({"function": function, "dropped": dropped})

    async def h_pins(self, request: web.Request) -> web.Response:
        return web.json_response({"pinned": sorted(self.km.pinned)})

    async def h_set_pins(self, request: web.Request) -> web.Response:
        """Replace the pinned stages: ``{"functions": [...], "sole": [...]}`` (the scheduler's keep_cached for
        this host; optionally the stages no other host holds, which are evicted after duplicates)."""
        body = await _json(request)
        if not isinstance(body, dict):
            raise invalid("functions", "the body must be {\"functions\": [<stage function name>, ...]}")
        names = {}
        for key in ("functions", "sole"):
            value = body.get(key, [] if key == "sole" else None)
            if not isinstance(value, list) or not all(isinstance(f, str) and _FUNCTION_RE.match(f) for f in value):
                raise invalid(key, f"{key} must be a list of stage function names")
            if len(value) > 4096:
                raise invalid(key, f"at most 4096 {key}")
            names[key] = value
        return web.json_response({"pinned": self.km.pin(names["functions"], names["sole"] if "sole" in body else None)})

    async def h_report(self, request: web.Request) -> web.Response:
        return web.json_response(self.km.report().to_dict())

    async def h_prefetch(self, request: web.Request) -> web.Response:
        """Start making the stage local (from ``peers``, else the registry) and answer at once (202): a chain's
        receivers are told in order, each before the next asks it for the bytes."""
        body = await _json(request)
        spec = self.spec(body)
        self.km.localizer.prefetch(spec, _peers(body))
        return web.json_response(self.km.localizer.status(spec.function), status=202)

    async def h_stage(self, request: web.Request) -> web.Response:
        function = self.function(request)
        info = self.km.localizer.status(function)
        if info["state"] == "absent" and self.km.stage_file(function) is not None:
            info["state"] = "held"
        return web.json_response(info)

    async def h_stage_file(self, request: web.Request) -> web.StreamResponse:
        """The stage's checkpoint bytes for a peer (Range supported; a file still arriving is served as it grows)."""
        function = self.function(request)
        stage = self.km.stage_file(function) or await self.km.localizer.wait_file(function)
        if stage is None:
            raise NotFound(f"this host holds no stage file of {function!r}", "function")
        try:
            return await serve_file(request, stage)
        except FileNotFoundError:  # removed meanwhile (a failed transfer, an eviction): asked before any header
            raise NotFound(f"this host holds no stage file of {function!r} any more", "function") from None

    def function(self, request: web.Request) -> str:
        function = request.match_info["function"]
        if not _FUNCTION_RE.match(function):
            raise invalid("function", "a function name is letters, digits, '_', '.', '-'")
        return function

    async def h_shutdown(self, request: web.Request) -> web.Response:
        asyncio.get_running_loop().call_later(0.05, self.km.request_stop)
        return web.json_response({"stopping": True})


async def _until_body_ends(request: web.Request) -> None:
    """Read a request body to its end; a dropped connection ends it too."""
    with contextlib.suppress(Exception):
        while await request.content.readany():
            pass


def _peers(body: dict, field: str = "peers") -> list[str]:
    """``peers``: KeysManagers (``http://HOST:PORT``) that hold the stage, tried in order before the registry."""
    peers = body.get("peers", [])
    if not isinstance(peers, list) or len(peers) > 64 or not all(isinstance(p, str) and _PEER_RE.match(p) for p in peers):
        raise invalid(field, f"{field} must be a list of at most 64 KeysManager addresses http://HOST:PORT")
    return peers


def _layers(body: dict, field: str = "layers") -> tuple[int, int] | None:
    """``layers``: ``[a, b]``, a part of the stage (absolute, half-open) to fetch and serve first (ParaServe)."""
    layers = body.get("layers")
    if layers is None:
        return None
    if (not isinstance(layers, list) or len(layers) != 2 or not all(type(x) is int and x >= 0 for x in layers)
            or layers[0] >= layers[1]):
        raise invalid(field, f"{field} must be [a, b] with 0 <= a < b (absolute layer indices), got {layers!r}")
    return layers[0], layers[1]


async def _json(request: web.Request, allow_empty: bool = False) -> Any:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise invalid("body", "the request body is empty; expected a JSON object")
    return jsonparse.loads(raw)


@web.middleware
async def _errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except QuartError as exc:
        return _answer(exc)
    except ManagerError as exc:
        return _answer(QuartError(_STATUS.get(type(exc), 500), exc.message, exc.field))
    except web.HTTPException as exc:
        return _answer(QuartError(exc.status, exc.reason))
    except Exception as exc:  # a bug must not take the daemon down; answer it
        return _answer(QuartError(500, f"internal error: {type(exc).__name__}: {exc}"))


def _answer(exc: QuartError) -> web.Response:
    return web.json_response(exc.to_json(), status=exc.status, headers=exc.headers)


def _check_cpus(cpus: Any, field: str) -> None:
    if isinstance(cpus, bool) or not isinstance(cpus, int | float) or not 0 < cpus <= 1024:
        raise invalid(field, f"{field} must be a number in (0, 1024]")
