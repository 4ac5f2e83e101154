"""The standalone plugin in its own event loop in front of the embedded gateway (standing in for OpenFaaS)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import requests
from aiohttp import web
from gateway_plugin.config import PluginConfig
from gateway_plugin.standalone import StandalonePlugin


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """``app`` served on an ephemeral loopback port of the running loop: its runner (``cleanup()`` stops it), url."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site.port
    return runner, f"http://127.0.0.1:{port}"


class Setup:
    def __init__(self, tmp_path) -> None:
        from quart_provider.config import GatewayConfig
        from quart_provider.system import EmbeddedSystem

        cfg = GatewayConfig(port=0, state_dir=tmp_path / "state", reconcile_interval_s=0.05, drain_timeout_s=5)
        self.system = EmbeddedSystem(cfg, use_keysmanager=False)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None
        self.call(self.system.start())
        creds = self.system.credentials
        for i in range(2):
            body = {"service": f"m-stage-{i}", "image": "quart/echo:latest",
                    "labels": {"com.quart.model": "m", "com.quart.stage": str(i), "com.openfaas.scale.min": "1",
                               "com.openfaas.scale.max": "3"}}
            res = requests.post(f"{self.system.url}/system/functions", json=body, auth=(creds.user, creds.password),
                                timeout=10)
            assert res.status_code == 202
        config = PluginConfig(gateway_url=self.system.url, gateway_user=creds.user, policy="static",
                              actuator="rest", control_period_s=0.2, replica_refresh_s=0.1)
        self.plugin = StandalonePlugin(config, creds.password)
        self.runner, self.url = self.call(serve(self.plugin.app()))

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            if self.runner is not None:
                self.call(self.runner.cleanup())
            self.call(self.system.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()



@pytest.fixture
def setup(tmp_path):
    s = Setup(tmp_path)
    try:
        yield s
    finally:
        s.close()

