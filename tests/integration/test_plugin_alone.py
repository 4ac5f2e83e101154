"""The standalone plugin runs without the embedded gateway (issue 26): in a process where ``quart_provider`` and
``quart_tools`` cannot be imported (as in its image, deploy/docker/plugin.Dockerfile), every plugin module
imports and ``python -m gateway_plugin.standalone`` serves ``/healthz`` and ``/metrics``. The AST rule in
tests/unit/test_structure.py says the same from the source; this catches an import made at run time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import requests
from support.embedded_system import ThreadedSystem, deploy_echo_pipeline

# Run first in the child: any import of the embedded gateway or the tools fails, as if they were not installed.
BLOCK = """
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("quart_provider", "quart_tools"):
            raise ModuleNotFoundError(f"No module named {name!r} (not shipped with the plugin)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""

IMPORT_ALL = BLOCK + """
import importlib, pkgutil, gateway_plugin
names = [m.name for m in pkgutil.walk_packages(gateway_plugin.__path__, "gateway_plugin.")]
for name in names:
    importlib.import_module(name)
try:
    import quart_provider  # noqa: F401
except ModuleNotFoundError:
    print(len(names), "modules; quart_provider absent")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_plugin_module_imports_without_the_embedded_gateway() -> None:
    res = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    count = int(res.stdout.split()[0])
    assert count >= 20 and "quart_provider absent" in res.stdout  # the walk saw the plugin, the block held


def test_the_standalone_plugin_serves_a_pipeline_without_the_embedded_gateway(tmp_path) -> None:
    """The embedded gateway stands in for OpenFaaS in this process; the plugin runs in another, where it cannot
    import quart_provider, and carries a pipeline call through both echo stages."""
    gateway = ThreadedSystem(tmp_path)
    proc = None
    log_path = tmp_path / "plugin.log"
    try:
        deploy_echo_pipeline(gateway, "m", 2, **{"com.openfaas.scale.min": "1"})
        password = tmp_path / "password"
        password.write_text(gateway.auth[1])
        password.chmod(0o600)
        port = _free_port()
        code = BLOCK + (
            "import runpy, sys\n"
            f"sys.argv = ['gateway_plugin.standalone', '--gateway', {gateway.url!r}, '--user', {gateway.auth[0]!r},"
            f" '--password-file', {str(password)!r}, '--port', '{port}']\n"
            "runpy.run_module('gateway_plugin.standalone', run_name='__main__')\n")
        env = {**os.environ, "QUART_POLICY": "static", "QUART_REPLICA_REFRESH_S": "0.1"}
        with log_path.open("w") as log:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                    env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        body = b"x" * 1024
        while True:  # until the plugin listens and has seen both stages' replicas ready
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no answer through the plugin: " + log_path.read_text()[-3000:]
            try:
                res = requests.post(f"{url}/function/m", data=body, timeout=10)
                if res.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        assert res.content == body  # echo stages: the body came back through both
        metrics = requests.get(f"{url}/metrics", timeout=5)
        assert metrics.status_code == 200 and "quart_stage_" in metrics.text
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        gateway.close()
    assert "No module named 'quart_provider" not in log_path.read_text()
