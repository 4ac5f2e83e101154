"""The embedded gateway driven as faas-cli drives it: Running (a ThreadedSystem with faas-cli shaped calls) and deploy bodies."""

from __future__ import annotations

import os
import time

import requests

from support.embedded_system import ThreadedSystem


def faas_cli_deploy_body(name: str, image: str = "quart/echo:latest", **extra) -> dict:
    """What faas-cli's proxy.deploy marshals from a stack.yml function (types.FunctionDeployment)."""
    body = {
        "service": name, "image": image, "envVars": {"write_debug": "false"},
        "labels": {"com.openfaas.scale.min": "1", "com.openfaas.scale.max": "4"},
        "annotations": {"topic": "demo"}, "limits": {"memory": "256Mi", "cpu": "500m"},
    }
    body.update(extra)
    return body



class Running(ThreadedSystem):
    """An EmbeddedSystem on its own event loop thread (faas-cli is an outside client)."""

    # faas-cli shaped calls ------------------------------------------------------------------
    def deploy(self, body: dict) -> requests.Response:
        res = requests.put(f"{self.url}/system/functions", json=body, auth=self.auth, timeout=30)
        if res.status_code == 404:
            res = requests.post(f"{self.url}/system/functions", json=body, auth=self.auth, timeout=30)
        return res

    def describe(self, name: str) -> requests.Response:
        return requests.get(f"{self.url}/system/function/{name}", params={"usage": "1"}, auth=self.auth, timeout=10)

    def scale(self, name: str, replicas) -> requests.Response:
        return requests.post(f"{self.url}/system/scale-function/{name}", json={"serviceName": name, "replicas": replicas},
                             auth=self.auth, timeout=10)

    def replicas(self, name: str) -> dict:
        return requests.get(f"{self.url}/system/replicas/{name}", auth=self.auth, timeout=10).json()

    def wait_available(self, name: str, count: int, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status = self.describe(name).json()
            live = [r for r in self.replicas(name)["replicas"] if r["state"] != "dead"]
            if status.get("availableReplicas") == count and len(live) == count:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: {status.get('availableReplicas')} available, want {count}; {live}")
            time.sleep(0.05)



def running_echo(folder, **config):
    """A Running system with ``quart/echo`` deployed as ``echo`` and one replica available (a generator for a
    pytest fixture: ``yield from running_echo(tmp, max_body_bytes=...)``); closed afterwards."""
    running = Running(folder, **config)
    try:
        assert running.deploy(faas_cli_deploy_body("echo")).status_code == 202
        running.wait_available("echo", 1)
        yield running
    finally:
        running.close()



def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False



def busy_function(running: Running):
    """Deploy ``busy`` (one replica, concurrency 1); returns ``occupy(n)``, which takes ``n`` of its slots."""
    body = faas_cli_deploy_body("busy", labels={"com.quart.concurrency": "1", "com.openfaas.scale.max": "1"})
    assert running.deploy(body).status_code == 202
    running.wait_available("busy", 1)
    fn = running.system.gateway.functions["busy"]

    async def take(n: int) -> None:
        fn.ready[0].in_flight += n

    return lambda n: running.call(take(n))

