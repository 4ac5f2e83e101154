"""The OpenFaaS handler contract (python3-http style) on top of StageRuntime.

A function's ``handler.py`` is two lines: ``from quart_stage.handler import StageHandler`` and
``handle = StageHandler.from_env()``. ``handle(event, context)`` returns the python3-http response dict
``{"statusCode", "body", "headers"}`` with a bytes body. ``GET /_/sessions`` and ``DELETE /_/sessions/<id>``
list and free generation sessions, as on a replica's own app (docs/generation.md).
"""

from __future__ import annotations

from quart_stage.attach import load_stage
from quart_stage.config import ConfigError, StageConfig
from quart_stage.runtime import StageRuntime

SESSIONS = "/_/sessions"


class StageHandler:
    """Callable ``handle(event, context)`` serving one stage; `GET` answers the stage's status."""

    def __init__(self, runtime: StageRuntime):
        self.runtime = runtime

    @classmethod
    def from_env(cls, env=None, family: str | None = None) -> StageHandler:
        """Load the stage the environment names (from the node's cache when QUART_KEYSMANAGER_SOCKET is set,
        see quart_stage.attach); `family` (decoder|encoder) refuses a model of another family."""
        runtime = load_stage(StageConfig.from_env(env))
        if family is not None and runtime.manifest is not None and runtime.manifest.family != family:
            raise ConfigError(f"this is the {family} handler but {runtime.cfg.model_dir} holds a "
                              f"{runtime.manifest.family} model ({runtime.model}); use the {runtime.manifest.family} handler in functions/")
        return cls(runtime)

    def __call__(self, event, context) -> dict:
        rt = self.runtime
        method, path = getattr(event, "method", "POST"), getattr(event, "path", "/") or "/"
        if path.rstrip("/") == SESSIONS and method == "GET":
            return {"statusCode": 200, "headers": {"Content-Type": "application/json"},
                    "body": rt.generation.table.snapshot()}
        if path.startswith(SESSIONS + "/") and method == "DELETE":
            status, doc = rt.generation.free(path[len(SESSIONS) + 1:])
            return {"statusCode": status, "headers": {"Content-Type": "application/json"}, "body": doc or b""}
        if method == "GET":
            return {"statusCode": 200, "headers": {"Content-Type": "application/json"},
                    "body": {"status": "ok", "model": rt.model, "stage": rt.stage_index,
                             "stages": rt.num_stages, "compute": rt.compute, "parameters": rt.parameter_source}}
        resp = rt.handle(event.body, event.headers)
        return {"statusCode": resp.status, "body": resp.body, "headers": resp.headers}
