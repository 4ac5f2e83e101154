"""Test helper: an embedded gateway system running on its own event-loop thread.

The tests talk to it over HTTP like an outside client (faas-cli, the REST actuator) would.
"""

from __future__ import annotations

import asyncio
import threading

from quart_provider.config import GatewayConfig
from quart_provider.system import EmbeddedSystem


class ThreadedSystem:
    """Start an EmbeddedSystem (process hosts, no KeysManager, unless ``use_keysmanager``: then real stage
    functions run) on a background loop; close() stops it."""

    def __init__(self, tmp_path, attach_plugin: bool = False, hold_queue: bool = False, use_keysmanager: bool = False,
                 **config) -> None:
        settings = dict(port=0, state_dir=tmp_path / "state", reconcile_interval_s=0.05, ready_wait_s=20,
                        drain_timeout_s=5, callback_allowed_networks="127.0.0.0/8,::1")
        settings.update(config)
        from gateway_plugin.plugin import attach

        self.system = EmbeddedSystem(GatewayConfig(**settings), use_keysmanager=use_keysmanager,
                                     plugin=attach if attach_plugin else None, hold_queue=hold_queue)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.system.start())
        self.url = self.system.url
        self.auth = (self.system.credentials.user, self.system.credentials.password)

    def start_queue_worker(self) -> None:
        """Run the async calls queued so far (a system started with ``hold_queue=True``)."""
        self.call(self.system.start_queue_worker())

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.call(self.system.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def deploy_echo_pipeline(system: ThreadedSystem, model: str, stages: int, **labels: str) -> None:
    """Deploy ``model`` as ``stages`` quart/echo stage functions (``<model>-stage-<i>``) through the REST API."""
    import requests

    for i in range(stages):
        body = {"service": f"{model}-stage-{i}", "image": "quart/echo:latest",
                "labels": {"com.quart.model": model, "com.quart.stage": str(i), "com.quart.stages": str(stages),
                           **labels}}
        res = requests.post(f"{system.url}/system/functions", json=body, auth=system.auth, timeout=30)
        assert res.status_code == 202, res.text


def plugin_system(tmp_path, monkeypatch, period_s: str = "0.2", **config) -> ThreadedSystem:
    """A ThreadedSystem with the plugin attached: control period ``period_s``, request records in tmp_path."""
    monkeypatch.setenv("QUART_CONTROL_PERIOD_S", period_s)
    monkeypatch.setenv("QUART_RECORDS", str(tmp_path / "records.jsonl"))
    return ThreadedSystem(tmp_path, attach_plugin=True, **config)


def stage_system(root) -> ThreadedSystem:
    """A ThreadedSystem with the plugin and one KeysManager host (real stage processes); policy static: nothing
    rescales the stages under a test."""
    import os

    os.environ["QUART_POLICY"] = "static"
    try:
        return ThreadedSystem(root, attach_plugin=True, use_keysmanager=True, hosts=1, gpus_per_host=8)
    finally:
        os.environ.pop("QUART_POLICY", None)


def deploy_stack(system: ThreadedSystem, model_dir, labels: dict[str, str] | None = None) -> list[str]:
    """Deploy a partition's stack.yml through the REST API (its images registered), ``labels`` added to every
    function; the function names."""
    from pathlib import Path

    import requests
    from quart_provider.stack import load_stack

    stack = load_stack(Path(model_dir) / "stack.yml")
    system.system.gateway.images.register(stack.image_index_entries())
    for fn in stack.functions:
        body = {**fn.request, "labels": {**fn.request.get("labels", {}), **(labels or {})}}
        res = requests.post(f"{system.url}/system/functions", json=body, auth=system.auth, timeout=30)
        assert res.status_code == 202, res.text
    return [fn.request["service"] for fn in stack.functions]


def wait_available(system: ThreadedSystem, want: dict[str, int], timeout_s: float = 180) -> None:
    """Until every function in ``want`` has at least that many available replicas."""
    import time

    import requests

    deadline = time.monotonic() + timeout_s
    while True:
        listing = {f["name"]: f["availableReplicas"] for f in
                   requests.get(f"{system.url}/system/functions", auth=system.auth, timeout=10).json()}
        if all(listing.get(k, 0) >= v for k, v in want.items()):
            return
        assert time.monotonic() < deadline, listing
        time.sleep(0.2)
