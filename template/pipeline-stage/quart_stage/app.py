"""The flask WSGI app of a stage replica (what the KeysManager and gunicorn serve).

``POST /`` (any path) invokes the stage; ``GET /_/health`` is 200 once the runtime is ready (the path
of-watchdog uses). ``GET /_/sessions`` lists the generation sessions (KV caches) the replica holds,
``DELETE /_/sessions/<id>`` frees one, ``GET``/``PUT /_/sessions/<id>/kv`` export and install its KV cache
(docs/generation.md). The body limit is enforced from Content-Length before a byte is read; more than
``QUART_MAX_INFLIGHT`` concurrent requests get 429 with Retry-After.

gunicorn: ``gunicorn 'quart_stage.app:create_app_from_env()'`` serves the stage named by the QUART_*
environment; ``create_mounts_app_from_env()`` serves several stages in one process under URL prefixes
(``QUART_STAGE_MOUNTS``, a JSON object ``{"/prefix": {"QUART_MODEL_DIR": ..., ...}}``), which the tests
and single-process demos use.
"""

from __future__ import annotations

import json
import os
import threading

from flask import Flask, Response, request

from quart_stage import kvroutes
from quart_stage.attach import load_stage
from quart_stage.config import StageConfig
from quart_stage.errors import QuartError, invalid
from quart_stage.layers import H_LAYERS_HELD
from quart_stage.runtime import StageResponse, StageRuntime

MOUNTS_ENV = "QUART_STAGE_MOUNTS"


class _Inflight:
    """Counts requests in progress; `limit` 0 means unlimited."""

    def __init__(self, limit: int):
        self.limit, self.count, self.lock = limit, 0, threading.Lock()

    def enter(self) -> bool:
        with self.lock:
            if self.limit and self.count >= self.limit:
                return False
            self.count += 1
            return True

    def leave(self) -> None:
        with self.lock:
            self.count -= 1


def read_body_limited(max_bytes: int) -> bytes:
    """The request body, or invalid(413) when it is (or announces to be) over `max_bytes`."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise invalid("body", f"body of {length} bytes is over the limit of {max_bytes} bytes "
                              "(QUART_MAX_BODY_BYTES)", status=413)
    data = request.stream.read(max_bytes + 1) if length is None else request.get_data(cache=False)
    if len(data) > max_bytes:
        raise invalid("body", f"body is over the limit of {max_bytes} bytes (QUART_MAX_BODY_BYTES)",
                              status=413)
    if length is not None and len(data) < length:
        raise invalid("body", f"body is truncated: Content-Length {length}, {len(data)} bytes arrived")
    return data


def to_flask(resp: StageResponse) -> Response:
    out = Response(resp.chunks, status=resp.status, headers=resp.headers, direct_passthrough=True)
    out.headers["Content-Length"] = str(sum(len(c) for c in resp.chunks))
    return out


def create_app(runtime: StageRuntime, name: str | None = None) -> Flask:
    """The WSGI app of one replica of `runtime`."""
    app = Flask(name or f"quart-stage-{runtime.model}-{runtime.stage_index}")
    inflight = _Inflight(runtime.cfg.max_inflight)
    max_body = runtime.cfg.max_body_bytes

    def _held() -> dict[str, str]:
        held = runtime.held()
        return {H_LAYERS_HELD: f"{held[0]}-{held[1]}"} if held else {}

    @app.get("/_/health")
    def health():
        return {"status": "ok", "model": runtime.model, "stage": runtime.stage_index,
                "stages": runtime.num_stages, "compute": runtime.compute,
                "parameters": runtime.parameter_source}, 200, _held()

    @app.get("/")
    def info():
        held = runtime.held()
        return {"model": runtime.model, "stage": runtime.stage_index, "stages": runtime.num_stages,
                "compute": runtime.compute, "parameter_bytes": runtime.parameter_bytes,
                "layers": list(runtime.stage_range) if runtime.stage_range else None,
                "layers_held": list(held) if held else None}, 200, _held()

    @app.get("/_/sessions")
    def sessions():
        """The generation sessions this replica holds and its KV-cache occupancy (docs/generation.md)."""
        return runtime.generation.table.snapshot(), 200, _held()

    @app.delete("/_/sessions/<session_id>")
    def end_session(session_id: str):
        status, doc = runtime.generation.free(session_id)
        return (doc or ""), status

    @app.get("/_/sessions/<session_id>/kv")
    def export_kv(session_id: str):
        """A session's KV cache, for a consolidating ParaServe group (quart_stage.kvroutes)."""
        return to_flask(kvroutes.export_response(runtime, session_id, request.args.get("layers"),
                                                 request.args.get("from")))

    @app.delete("/_/sessions/<session_id>/kv")
    def trim_kv(session_id: str):
        """Drop the first layers of a session's part (a re-cut moved their cache; quart_stage.kvroutes)."""
        return to_flask(kvroutes.trim_response(runtime, session_id, request.args.get("layers")))

    @app.put("/_/sessions/<session_id>/kv")
    def import_kv(session_id: str):
        try:
            body = read_body_limited(max_body)
        except QuartError as exc:
            return to_flask(StageResponse.error(exc, {"Connection": "close"}))
        return to_flask(kvroutes.import_response(runtime, session_id, body, request.headers))

    @app.post("/", defaults={"path": ""})
    @app.post("/<path:path>")
    def invoke(path: str):
        request_id = request.headers.get("X-Quart-Request-Id")
        if not inflight.enter():
            return to_flask(StageResponse.json(
                429, {"error": f"replica is at QUART_MAX_INFLIGHT={inflight.limit} requests in flight", "field": "load"},
                {**runtime.response_headers(request_id), "Retry-After": "1"}))
        try:
            try:
                body = read_body_limited(max_body)
            except QuartError as exc:
                return to_flask(StageResponse.error(exc, {**runtime.response_headers(request_id), "Connection": "close"}))
            return to_flask(runtime.handle(body, request.headers))
        finally:
            inflight.leave()

    return app


def create_app_from_env(env=None) -> Flask:
    """Load the stage named by the QUART_* environment (from the node's cache when QUART_KEYSMANAGER_SOCKET is
    set, see quart_stage.attach) and return its app (gunicorn factory)."""
    runtime = load_stage(StageConfig.from_env(env))
    runtime.prepare_device()
    return create_app(runtime)


def create_mounts_app_from_env(env=None):
    """Several stages in one WSGI app under URL prefixes, from ``QUART_STAGE_MOUNTS`` (JSON)."""
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    env = dict(os.environ if env is None else env)
    mounts = json.loads(env[MOUNTS_ENV])
    apps = {}
    for prefix, overrides in mounts.items():
        stage_env = {**env, **{k: str(v) for k, v in overrides.items()}}
        apps[prefix] = create_app_from_env(stage_env)
    root = Flask("quart-stage-mounts")

    @root.get("/_/health")
    def health():
        return {"status": "ok", "mounts": sorted(apps)}

    return DispatcherMiddleware(root, apps)
