"""Two fronts on one deployment (issue 40): the embedded gateway (its attached plugin) and the standalone plugin
(``gateway_plugin.standalone``) in front of that same gateway, standing in for OpenFaaS. Real stage replicas
(KeysManager host, policy static) of the random ``tiny`` llama (2 stages, chat template), MiniLM (2 stages) and
``zt`` (``tiny`` again, ``com.openfaas.scale.min: 0``). Made once per test module; a test asks for a
:class:`Front` and talks to it over HTTP like a client."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests
from gateway_plugin.config import PluginConfig
from gateway_plugin.standalone import StandalonePlugin
from quart_tools.partition import partition

from support.embedded_system import ThreadedSystem, deploy_stack, stage_system, wait_available
from support.generation_app import CHATML
from support.standalone import serve

FRONTS = ("embedded", "standalone")
MODELS = {"tiny": ("tiny", 1), "minilm": ("minilm", 1), "zt": ("tiny", 0)}  # name: (preset, scale.min)
STAGES = 2


def partition_models(root: Path) -> dict[str, Path]:
    """The three models partitioned in ``root`` (scale.max 1 each: the static policy holds one replica)."""
    dirs = {}
    for name, (preset, scale_min) in MODELS.items():
        out = root / name
        partition(preset, STAGES, str(out), seed=3, name=name if name != preset else None, progress=False,
                  stack={"compute": "cpu", "scale_min": scale_min, "scale_max": 1})
        if preset == "tiny":
            (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                   "chat_template": CHATML}))
        dirs[name] = out
    return dirs


class Deployment:
    """The embedded gateway with the three models deployed and ready (``zt`` at zero), and the standalone
    plugin served on the gateway's event loop, in front of it."""

    def __init__(self, root: Path) -> None:
        self.dirs = partition_models(root)
        self.system: ThreadedSystem = stage_system(root)
        self.runner = None
        try:
            for model_dir in self.dirs.values():
                deploy_stack(self.system, model_dir)
            wait_available(self.system, {f"{m}-stage-{i}": 1 for m in ("tiny", "minilm") for i in range(STAGES)})
            user, password = self.system.auth
            config = PluginConfig(gateway_url=self.system.url, gateway_user=user, policy="static", actuator="rest",
                                  control_period_s=0.2, replica_refresh_s=0.2)
            self.plugin = StandalonePlugin(config, password)
            self.runner, self.standalone_url = self.system.call(serve(self.plugin.app()))
        except BaseException:
            self.close()
            raise

    def front(self, name: str) -> Front:
        return Front(name, self.system.url if name == "embedded" else self.standalone_url, self)

    def listing(self) -> dict[str, dict]:
        res = requests.get(f"{self.system.url}/system/functions", auth=self.system.auth, timeout=10)
        return {f["name"]: f for f in res.json()}

    def replica_pids(self, function: str) -> list[int]:
        """The processes of ``function``'s ready replicas (those listening on their urls' ports)."""
        ports = {int(e.url.rstrip("/").rsplit(":", 1)[1].split("/")[0])
                 for e in self.system.system.gateway.functions[function].ready}
        return [c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port in ports and c.pid]

    def close(self) -> None:
        try:
            if self.runner is not None:
                self.system.call(self.runner.cleanup())
        finally:
            self.system.close()


@dataclass
class Front:
    """One front of the deployment: ``url`` is where clients call ``/function/<model>`` and ``/v1``."""

    name: str
    url: str
    deployment: Deployment

    def sees(self, function: str) -> int:
        """The replicas (slots) of ``function`` this front dispatches to now."""
        if self.name == "standalone":
            return len(self.deployment.plugin.view.ready(function))
        return len(self.deployment.system.system.gateway.functions[function].ready)

    def wait_sees(self, want: dict[str, int], timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while (seen := {f: self.sees(f) for f in want}) != want:
            assert time.monotonic() < deadline, f"{self.name} sees {seen}, want {want}"
            time.sleep(0.1)

    def post(self, path: str, timeout: float = 60, **kwargs) -> requests.Response:
        return requests.post(f"{self.url}{path}", timeout=timeout, **kwargs)


def scale_bound(deployment: Deployment, function: str, scale_max: int) -> None:
    """Set ``function``'s ``com.openfaas.scale.max`` with ``PUT /system/functions`` (the rest of it unchanged, as
    the REST actuator redeploys); the static policy then scales it there through the plugins' actuators."""
    from gateway_plugin.actuators.rest import deployment_from_status

    system = deployment.system
    status = requests.get(f"{system.url}/system/function/{function}", auth=system.auth, timeout=10).json()
    body = deployment_from_status(function, status)
    body["labels"] = {**body["labels"], "com.openfaas.scale.max": str(scale_max)}
    res = requests.put(f"{system.url}/system/functions", json=body, auth=system.auth, timeout=30)
    assert res.status_code in (200, 202), res.text


def scale_to_zero(deployment: Deployment, model: str) -> None:
    """Every stage of ``model`` to zero through ``POST /system/scale-function``; until none is available."""
    system = deployment.system
    for i in range(STAGES):
        name = f"{model}-stage-{i}"
        res = requests.post(f"{system.url}/system/scale-function/{name}", json={"serviceName": name, "replicas": 0},
                            auth=system.auth, timeout=10)
        assert res.status_code in (200, 202), res.text
    deadline = time.monotonic() + 60
    while any(deployment.listing()[f"{model}-stage-{i}"]["availableReplicas"] for i in range(STAGES)):
        assert time.monotonic() < deadline, deployment.listing()
        time.sleep(0.1)
