"""``/ui/``: the status page the embedded gateway serves behind its basic auth (``gateway.ui_hook``).

``/ui/`` is ``ui/index.html``; ``/ui/app.js`` and ``/ui/style.css`` are the other static files (plain
HTML/JS/CSS in the package, no build step); ``/ui/api/status`` is the JSON the page polls every second
(:func:`gateway_plugin.status.status_document`). Anything else under ``/ui/`` is a 404.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from aiohttp import web
from gateway_plugin.status import status_document

STATIC = {"": ("index.html", "text/html"), "index.html": ("index.html", "text/html"),
          "app.js": ("app.js", "application/javascript"), "style.css": ("style.css", "text/css")}


def static_file(name: str) -> bytes:
    return resources.files("gateway_plugin.ui").joinpath(name).read_bytes()


def make_ui_hook(plugin: Any):
    """The ``gateway.ui_hook`` of ``plugin``: (request, path under /ui/) → response."""

    async def ui(request: web.Request, tail: str) -> web.StreamResponse:
        if tail == "api/status":
            return web.json_response(status_document(plugin), dumps=lambda d: json.dumps(d, default=str),
                                     headers={"Cache-Control": "no-store"})
        if tail in STATIC:
            name, content_type = STATIC[tail]
            return web.Response(body=static_file(name), content_type=content_type, charset="utf-8",
                                headers={"Cache-Control": "no-cache"})
        return web.json_response({"error": f"no page /ui/{tail}; the status page is /ui/", "field": "path"},
                                 status=404)

    return ui
