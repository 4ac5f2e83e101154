"""Actuators driven against the embedded gateway: REST calls, and faas-cli (a fake faas-cli on PATH
that records its argv and performs the deploy the way faas-cli does: PUT /system/functions)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time

import pytest
import requests
from gateway_plugin.actuators import ActuatorError
from gateway_plugin.actuators.faas_cli import FaasCliActuator, deploy_command
from gateway_plugin.actuators.rest import RestActuator
from support.embedded_system import ThreadedSystem


class Gateway(ThreadedSystem):
    def __init__(self, tmp_path) -> None:
        super().__init__(tmp_path)
        self.user, self.password = self.auth
        body = {"service": "m-stage-0", "image": "quart/echo:latest", "envVars": {"A": "1"},
                "labels": {"com.openfaas.scale.min": "1", "com.openfaas.scale.max": "6", "com.quart.model": "m"},
                "limits": {"cpu": "1", "memory": "128Mi"}}
        assert requests.post(f"{self.url}/system/functions", json=body, auth=(self.user, self.password),
                             timeout=10).status_code == 202

    def describe(self) -> dict:
        return requests.get(f"{self.url}/system/function/m-stage-0", auth=(self.user, self.password), timeout=10).json()


@pytest.fixture
def gw(tmp_path):
    g = Gateway(tmp_path)
    try:
        yield g
    finally:
        g.close()


def test_rest_actuator_scales_and_sets_cpus(gw) -> None:
    act = RestActuator(gw.url, gw.user, gw.password)

    async def run() -> None:
        try:
            await act.scale("m-stage-0", 3, key=True)
            await act.set_cpus("m-stage-0", 2.5)
            with pytest.raises(ActuatorError, match="404"):
                await act.scale("nope", 1)
        finally:
            await act.close()

    asyncio.run(run())
    status = gw.describe()
    assert status["replicas"] == 3
    assert status["limits"]["cpu"] == "2.5" and status["limits"]["memory"] == "128Mi"
    assert status["envVars"] == {"A": "1"} and status["labels"]["com.quart.model"] == "m"
    bad = RestActuator(gw.url, gw.user, "wrong")

    async def unauthorised() -> None:
        try:
            await bad.scale("m-stage-0", 2)
        finally:
            await bad.close()

    with pytest.raises(ActuatorError, match="401"):
        asyncio.run(unauthorised())


FAKE_FAAS_CLI = """\
#!{python}
# A stand-in for faas-cli: records argv, keeps the login password, deploys with PUT like faas-cli.
import json, os, sys, requests
state = os.environ["FAKE_FAAS_DIR"]
args = sys.argv[1:]
with open(os.path.join(state, "calls.jsonl"), "a") as fh:
    fh.write(json.dumps(args) + "\\n")
def opt(name, many=False):
    vals = [args[i + 1] for i, a in enumerate(args) if a == name]
    return vals if many else (vals[-1] if vals else None)
if args[0] == "login":
    open(os.path.join(state, "password"), "w").write(sys.stdin.read())
    open(os.path.join(state, "user"), "w").write(opt("--username"))
    sys.exit(0)
if args[0] == "deploy":
    auth = (open(os.path.join(state, "user")).read(), open(os.path.join(state, "password")).read())
    body = {{"service": opt("--name"), "image": opt("--image"),
            "envVars": dict(e.split("=", 1) for e in opt("--env", True)),
            "labels": dict(e.split("=", 1) for e in opt("--label", True)),
            "annotations": dict(e.split("=", 1) for e in opt("--annotation", True)),
            "limits": {{k: v for k, v in (("cpu", opt("--cpu-limit")), ("memory", opt("--memory-limit"))) if v}}}}
    r = requests.put(opt("--gateway") + "/system/functions", json=body, auth=auth, timeout=10)
    print("Deployed." if r.status_code < 300 else r.text)
    sys.exit(0 if r.status_code < 300 else 1)
sys.exit(2)
"""


@pytest.fixture
def fake_faas_cli(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "faas-cli"
    script.write_text(FAKE_FAAS_CLI.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_FAAS_DIR", str(tmp_path))
    return tmp_path


def test_deploy_command_keeps_the_function_and_sets_scale_and_cpu() -> None:
    status = {"name": "f", "image": "img:1", "namespace": "openfaas-fn", "envVars": {"B": "2", "A": "1"},
              "labels": {"com.openfaas.scale.min": "1", "com.openfaas.scale.max": "4", "x": "y"},
              "limits": {"cpu": "1", "memory": "1Gi"}}
    argv = deploy_command("http://gw:8080", status, replicas=6, cpus=2.0)
    assert argv[:8] == ["faas-cli", "deploy", "--gateway", "http://gw:8080", "--name", "f", "--image", "img:1"]
    pairs = list(zip(argv[8::2], argv[9::2], strict=True))
    assert ("--label", "com.openfaas.scale.min=6") in pairs and ("--label", "com.openfaas.scale.max=6") in pairs
    assert ("--label", "x=y") in pairs and ("--env", "A=1") in pairs and ("--env", "B=2") in pairs
    assert ("--cpu-limit", "2") in pairs and ("--memory-limit", "1Gi") in pairs
    assert all("password" not in a for a in argv)


def test_faas_cli_actuator_redeploys_through_fake_cli(gw, fake_faas_cli) -> None:
    act = FaasCliActuator(gw.url, gw.user, gw.password)
    assert act.binary.endswith("bin/faas-cli")

    async def run() -> None:
        try:
            await act.scale("m-stage-0", 4)
            await act.set_cpus("m-stage-0", 2)
            await act.scale("m-stage-0", 2)  # down: min lowered by deploy, count lowered by REST
        finally:
            await act.close()

    asyncio.run(run())
    calls = [json.loads(line) for line in (fake_faas_cli / "calls.jsonl").read_text().splitlines()]
    assert calls[0][:1] == ["login"] and "--password-stdin" in calls[0]
    assert all(gw.password not in " ".join(c) for c in calls)
    deploys = [c for c in calls if c[0] == "deploy"]
    assert len(deploys) == 3
    assert "com.openfaas.scale.min=4" in deploys[0] and "--cpu-limit" in deploys[1]
    status = gw.describe()
    assert status["labels"]["com.openfaas.scale.min"] == "2"
    assert status["limits"]["cpu"] == "2" and status["envVars"] == {"A": "1"}
    deadline = time.monotonic() + 10
    while gw.describe()["replicas"] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_faas_cli_missing_is_a_clear_error(gw, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    act = FaasCliActuator(gw.url, gw.user, gw.password, binary="faas-cli")

    async def run() -> None:
        try:
            await act.scale("m-stage-0", 2)
        finally:
            await act.close()

    with pytest.raises(ActuatorError, match="not on PATH"):
        asyncio.run(run())
