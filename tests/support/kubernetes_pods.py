"""The standalone plugin with ``QUART_PLATFORM=kubernetes`` over real stage "pods" on loopback: each pod is the
stage's own WSGI app (quart_stage.app, a real ``tiny`` runtime) on its own port, listed in a fake EndpointSlice
API (tests/support/fake_endpointslices.py); a fake OpenFaaS gateway answers ``GET /system/functions`` with the
stack's functions (what faas-netes would list). Everything async runs on one background loop."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from gateway_plugin.config import PluginConfig
from gateway_plugin.standalone import StandalonePlugin
from quart_stage.app import create_app_from_env
from werkzeug.serving import WSGIRequestHandler, make_server

from support.fake_endpointslices import FakeEndpointSlices, endpoint_slice

logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per pod request otherwise

NAMESPACE = "openfaas-fn"
TOKEN = "fake-service-account-token"


class OneRequest(WSGIRequestHandler):
    """One request a connection, so that a stopped pod refuses the next call (no kept-alive connection serves on)."""

    protocol_version = "HTTP/1.0"


class StagePod:
    """One pod: the stage's WSGI app on a loopback port; ``steps``: (session id, status) of each session step."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.app = create_app_from_env(env)
        self.steps: list[tuple[str, int]] = []
        self.server = make_server("127.0.0.1", 0, self._wsgi, threaded=True, request_handler=OneRequest)
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _wsgi(self, environ, start_response):
        session = environ.get("HTTP_X_QUART_SESSION")
        if session is None or environ["REQUEST_METHOD"] != "POST":
            return self.app(environ, start_response)

        def start(status, headers, exc_info=None):
            self.steps.append((session, int(status.split()[0])))
            return start_response(status, headers, exc_info)

        return self.app(environ, start)

    def stop(self) -> None:
        """The pod's process is gone: calls in progress end, new ones are refused."""
        if not self.thread.is_alive():
            return
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def function_statuses(stack_file: Path, replicas: dict[str, int]) -> list[dict[str, Any]]:
    """``GET /system/functions`` of a gateway that deployed ``stack_file`` (faas-netes' FunctionStatus fields)."""
    doc = yaml.safe_load(stack_file.read_text())
    return [{"name": name, "image": fn["image"], "namespace": NAMESPACE, "labels": fn.get("labels") or {},
             "envVars": fn.get("environment") or {}, "limits": fn.get("limits") or {},
             "replicas": replicas[name], "availableReplicas": replicas[name]}
            for name, fn in doc["functions"].items()]


class PodCluster:
    """``pods[function]``: its StagePods, all listed ready in one EndpointSlice each at the start."""

    def __init__(self, tmp_path: Path, stack_file: Path, layout: dict[str, int]) -> None:
        doc = yaml.safe_load(stack_file.read_text())
        self.pods = {fn: [StagePod(f"{fn}-{chr(97 + j)}", dict(doc["functions"][fn]["environment"]))
                          for j in range(count)] for fn, count in layout.items()}
        self.statuses = function_statuses(stack_file, layout)
        credentials = tmp_path / "serviceaccount"
        credentials.mkdir()
        (credentials / "token").write_text(TOKEN)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []
        self.api = self.call(FakeEndpointSlices(TOKEN).start())
        gateway = self.call(self._serve(self._gateway_app()))
        for fn, pods in self.pods.items():
            for pod in pods:
                self.call(self.api.put(NAMESPACE, self.slice(fn, pod)))
        self.plugin = StandalonePlugin(PluginConfig(
            gateway_url=gateway, policy="static", actuator="none", control_period_s=0.5, replica_refresh_s=0.2,
            platform="kubernetes", kubernetes_api_url=self.api.url, kubernetes_credentials_dir=str(credentials)))
        self.url = self.call(self._serve(self.plugin.app()))

    @staticmethod
    def slice(function: str, pod: StagePod) -> dict[str, Any]:
        """The pod's own EndpointSlice (each pod listens on its own loopback port; a slice's endpoints share one)."""
        return endpoint_slice(f"{pod.name}-slice", function, [(pod.name, "127.0.0.1", True)], port=pod.port)

    def _gateway_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/system/functions", lambda r: web.json_response(self.statuses))
        return app

    async def _serve(self, app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def remove(self, pod: StagePod) -> None:
        """The pod leaves the function's EndpointSlices (it still answers: a terminating pod that still serves)."""
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            self.api.delete(NAMESPACE, f"{pod.name}-slice"), self.loop))

    def wait_ready(self, timeout_s: float = 30) -> None:
        """Until the plugin sees every listed pod ready."""
        deadline = time.monotonic() + timeout_s
        while any(len(self.plugin.view.ready(fn)) != len(pods) for fn, pods in self.pods.items()):
            assert time.monotonic() < deadline, "the plugin did not see the pods"
            time.sleep(0.05)

    def sessions_by_pod(self, function: str) -> dict[str, collections.Counter]:
        """pod name -> session ids it answered steps of (with how many)."""
        return {p.name: collections.Counter(s for s, _ in p.steps) for p in self.pods[function]}

    def close(self) -> None:
        try:
            for runner in reversed(self.runners):
                self.call(runner.cleanup())
            self.call(self.api.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            for pods in self.pods.values():
                for pod in pods:
                    pod.stop()
