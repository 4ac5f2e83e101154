"""Contract tests: the embedded gateway driven with the exact requests faas-cli sends.

Request shapes come from faas-cli's proxy/ (deploy.go: PUT then POST on 404; delete.go; scale.go;
describe.go; list.go; commands/login.go: GET /system/functions with basic auth) and faas-provider's
types; responses are checked against the schemas of openfaas/faas api-docs/spec.openapi.yml
(transcribed below). Replicas are real processes (the built-in quart/echo function).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
import requests
from support.faas_cli import Running, faas_cli_deploy_body, pid_alive

# spec.openapi.yml components/schemas (property names and JSON types)
FUNCTION_STATUS = {
    "required": {"name", "image"},
    "properties": {
        "name": str, "image": str, "namespace": str, "envProcess": str, "envVars": dict, "constraints": list,
        "secrets": list, "labels": dict, "annotations": dict, "limits": dict, "requests": dict,
        "readOnlyRootFilesystem": bool, "invocationCount": (int, float), "replicas": (int, float),
        "availableReplicas": (int, float), "createdAt": str, "usage": dict,
        "status": str, "reason": str,  # extensions (docs/openapi.yml): Ready / Not Ready and why
    },
}
GATEWAY_INFO = {"required": {"provider", "version", "arch"}}
PROVIDER_INFO = {"required": {"provider", "orchestration", "version"}}
VERSION_INFO = {"required": {"sha", "release"}}
FUNCTION_RESOURCES = {"memory", "cpu"}


def check_function_status(doc: dict) -> None:
    assert FUNCTION_STATUS["required"] <= doc.keys()
    for key, value in doc.items():
        assert key in FUNCTION_STATUS["properties"], f"{key} is not a FunctionStatus property"
        assert isinstance(value, FUNCTION_STATUS["properties"][key]), f"{key}={value!r} has the wrong type"
    for key in ("envVars", "labels", "annotations"):
        assert all(isinstance(v, str) for v in doc.get(key, {}).values())
    for key in ("limits", "requests"):
        assert set(doc.get(key, {})) <= FUNCTION_RESOURCES
    datetime.fromisoformat(doc["createdAt"].replace("Z", "+00:00"))


@pytest.fixture
def gw(tmp_path):
    running = Running(tmp_path, max_body_bytes=256 * 1024, max_deploy_bytes=64 * 1024)
    try:
        yield running
    finally:
        running.close()


def test_login_checks_credentials_like_faas_cli(gw):
    assert requests.get(f"{gw.url}/system/functions", auth=gw.auth, timeout=5).status_code == 200
    wrong = requests.get(f"{gw.url}/system/functions", auth=("admin", "nope"), timeout=5)
    assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"].startswith("Basic")
    assert requests.get(f"{gw.url}/system/functions", timeout=5).status_code == 401
    assert requests.get(f"{gw.url}/system/info", timeout=5).status_code == 401
    mode = gw.system.credentials.password_file.stat().st_mode & 0o777
    assert mode == 0o600
    assert requests.get(f"{gw.url}/healthz", timeout=5).status_code == 200
    assert requests.get(f"{gw.url}/health", timeout=5).status_code == 200  # vLLM's path, unauthenticated


def test_system_info_and_namespaces_follow_the_spec(gw):
    info = requests.get(f"{gw.url}/system/info", auth=gw.auth, timeout=5).json()
    assert GATEWAY_INFO["required"] <= info.keys()
    assert PROVIDER_INFO["required"] <= info["provider"].keys()
    assert VERSION_INFO["required"] <= info["version"].keys()
    assert requests.get(f"{gw.url}/system/namespaces", auth=gw.auth, timeout=5).json() == ["openfaas-fn"]


def test_deploy_list_describe_invoke_scale_update_remove(gw):
    res = requests.put(f"{gw.url}/system/functions", json=faas_cli_deploy_body("echo"), auth=gw.auth, timeout=10)
    assert res.status_code == 404  # faas-cli's update attempt on a new function ...
    res = requests.post(f"{gw.url}/system/functions", json=faas_cli_deploy_body("echo"), auth=gw.auth, timeout=10)
    assert res.status_code == 202  # ... then the deploy
    status = gw.wait_available("echo", 1)
    check_function_status(status)
    assert status["replicas"] == 1 and status["limits"] == {"memory": "256Mi", "cpu": "500m"}
    assert status["labels"]["com.openfaas.scale.max"] == "4"

    listing = requests.get(f"{gw.url}/system/functions", auth=gw.auth, timeout=5).json()
    assert [f["name"] for f in listing] == ["echo"]
    for doc in listing:
        check_function_status(doc)

    body = os.urandom(1024)
    for path in ("/function/echo", "/function/echo.openfaas-fn", "/function/echo/sub/path?x=1"):
        res = requests.post(gw.url + path, data=body, headers={"Content-Type": "application/octet-stream"}, timeout=10)
        assert res.status_code == 200 and res.content == body and res.headers["X-Call-Id"]
    assert gw.describe("echo").json()["invocationCount"] == 3

    assert gw.scale("echo", 3).status_code in (200, 202)
    gw.wait_available("echo", 3)
    assert gw.scale("echo", 9).json()["replicas"] == 4  # clamped to com.openfaas.scale.max
    gw.wait_available("echo", 4)
    gw.scale("echo", 2)
    gw.wait_available("echo", 2)

    # update (faas-cli's PUT answers 200): a rolling update to generation 2, never without a ready replica
    updated = faas_cli_deploy_body("echo", envVars={"write_debug": "true"})
    with ThreadPoolExecutor(1) as pool:
        stop = threading.Event()

        def hammer() -> list[int]:
            codes = []
            while not stop.is_set():
                codes.append(requests.post(f"{gw.url}/function/echo", data=b"x", timeout=10).status_code)
            return codes

        future = pool.submit(hammer)
        assert gw.deploy(updated).status_code == 200
        deadline = time.monotonic() + 30
        while True:
            reps = gw.replicas("echo")["replicas"]
            if reps and all(r["generation"] == 2 and r["state"] == "ready" for r in reps) and len(reps) == 2:
                break
            assert time.monotonic() < deadline, reps
            time.sleep(0.05)
        stop.set()
        codes = future.result(30)
    assert codes and set(codes) == {200}
    assert gw.describe("echo").json()["envVars"] == {"write_debug": "true"}

    pids = [r.pid for r in gw.call(gw.system.gateway.hosts["host-0"].replicas())]
    res = requests.delete(f"{gw.url}/system/functions", json={"functionName": "echo"}, auth=gw.auth, timeout=10)
    assert res.status_code == 200
    assert gw.describe("echo").status_code == 404
    assert requests.post(f"{gw.url}/function/echo", data=b"x", timeout=5).status_code == 404
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, "replica processes outlived their function"
        time.sleep(0.05)
    res = requests.delete(f"{gw.url}/system/functions", json={"functionName": "echo"}, auth=gw.auth, timeout=10)
    assert res.status_code == 404


def test_scale_to_zero_and_back_from_zero_on_invoke(gw):
    assert gw.deploy(faas_cli_deploy_body("zero")).status_code == 202
    gw.wait_available("zero", 1)
    assert gw.scale("zero", 0).status_code == 202
    gw.wait_available("zero", 0)
    res = requests.post(f"{gw.url}/function/zero", data=b"wake", timeout=30)
    assert res.status_code == 200 and res.content == b"wake"
    assert gw.describe("zero").json()["replicas"] == 1


def test_scale_key_hint_reaches_the_gateway_placer_history(gw):
    """The REST actuator's non-standard ``"key": true`` is passed to ``scale(..., key=)``; a bad one is a 400."""
    assert gw.deploy(faas_cli_deploy_body("keyed")).status_code == 202
    gw.wait_available("keyed", 1)
    history = gw.system.gateway.key_history
    res = requests.post(f"{gw.url}/system/scale-function/keyed", json={"serviceName": "keyed", "replicas": 2},
                        auth=gw.auth, timeout=10)
    assert res.status_code == 202 and "keyed" not in history  # faas-cli's shape: no hint
    res = requests.post(f"{gw.url}/system/scale-function/keyed",
                        json={"serviceName": "keyed", "replicas": 3, "key": True}, auth=gw.auth, timeout=10)
    assert res.status_code == 202 and res.json() == {"serviceName": "keyed", "replicas": 3}
    assert history.get("keyed") == 1  # counted as a key-stage scale-up
    res = requests.post(f"{gw.url}/system/scale-function/keyed",
                        json={"serviceName": "keyed", "replicas": 3, "key": "yes"}, auth=gw.auth, timeout=10)
    assert res.status_code == 400 and res.json()["field"] == "key"
    gw.wait_available("keyed", 3)


def test_bad_input_is_rejected_without_disturbing_running_functions(gw):
    assert gw.deploy(faas_cli_deploy_body("steady")).status_code == 202
    gw.wait_available("steady", 1)
    [before] = gw.replicas("steady")["replicas"]
    post = lambda body, **kw: requests.post(f"{gw.url}/system/functions", data=body, auth=gw.auth, timeout=5, **kw)  # noqa: E731

    res = post(b"{not json")
    assert res.status_code == 400 and res.json()["field"] == "body"
    res = requests.post(f"{gw.url}/system/functions", json={"service": "noimage"}, auth=gw.auth, timeout=5)
    assert res.status_code == 400 and res.json()["field"] == "image"
    res = requests.post(f"{gw.url}/system/functions", json={"image": "quart/echo"}, auth=gw.auth, timeout=5)
    assert res.status_code == 400 and res.json()["field"] == "service"
    res = requests.post(f"{gw.url}/system/functions", json={"service": "Bad_Name", "image": "quart/echo"},
                        auth=gw.auth, timeout=5)
    assert res.status_code == 400 and res.json()["field"] == "service"
    res = requests.post(f"{gw.url}/system/functions", json={"service": "x", "image": "nginx:latest"}, auth=gw.auth,
                        timeout=5)
    assert res.status_code == 400 and res.json()["field"] == "image" and "cannot resolve" in res.json()["error"]
    res = requests.post(f"{gw.url}/system/functions", json=faas_cli_deploy_body("y", limits={"memory": "lots"}),
                        auth=gw.auth, timeout=5)
    assert res.status_code == 400 and res.json()["field"] == "limits.memory"
    res = requests.post(f"{gw.url}/system/functions", json=faas_cli_deploy_body("steady"), auth=gw.auth, timeout=5)
    assert res.status_code == 400  # POST of an existing function: use PUT
    res = requests.put(f"{gw.url}/system/functions", json=faas_cli_deploy_body("ghost"), auth=gw.auth, timeout=5)
    assert res.status_code == 404

    res = gw.scale("steady", -1)
    assert res.status_code == 400 and res.json()["field"] == "replicas"
    res = gw.scale("steady", "two")
    assert res.status_code == 400 and res.json()["field"] == "replicas"
    assert gw.scale("ghost", 1).status_code == 404
    assert gw.describe("ghost").status_code == 404
    assert requests.post(f"{gw.url}/function/ghost", data=b"x", timeout=5).status_code == 404
    assert requests.post(f"{gw.url}/function/steady.other-ns", data=b"x", timeout=5).status_code == 404
    res = requests.delete(f"{gw.url}/system/functions", json={}, auth=gw.auth, timeout=5)
    assert res.status_code == 400 and res.json()["field"] == "functionName"

    big = requests.post(f"{gw.url}/function/steady", data=b"x" * (256 * 1024 + 1), timeout=10)
    assert big.status_code == 413 and big.json()["field"] == "body"
    big = post(b"{" + b" " * (64 * 1024) + b"}")
    assert big.status_code == 413
    wrong = requests.post(f"{gw.url}/system/scale-function/steady", json={"replicas": 0}, auth=("admin", "x"), timeout=5)
    assert wrong.status_code == 401

    [after] = gw.replicas("steady")["replicas"]
    assert after["id"] == before["id"] and after["state"] == "ready"
    res = requests.post(f"{gw.url}/function/steady", data=b"still here", timeout=5)
    assert res.status_code == 200 and res.content == b"still here"
    assert [f["name"] for f in requests.get(f"{gw.url}/system/functions", auth=gw.auth, timeout=5).json()] == ["steady"]


def test_metrics_use_the_openfaas_gateway_names(gw):
    assert gw.deploy(faas_cli_deploy_body("counted")).status_code == 202
    gw.wait_available("counted", 1)
    for _ in range(5):
        assert requests.post(f"{gw.url}/function/counted", data=b"x", timeout=5).status_code == 200
    text = requests.get(f"{gw.url}/metrics", timeout=5).text
    assert 'gateway_function_invocation_total{code="200",function_name="counted.openfaas-fn"} 5.0' in text
    assert 'gateway_function_invocation_started{function_name="counted.openfaas-fn"} 5.0' in text
    assert 'gateway_functions_seconds_count{code="200",function_name="counted.openfaas-fn"} 5.0' in text
    assert 'gateway_functions_seconds_bucket{code="200",function_name="counted.openfaas-fn",le="+Inf"} 5.0' in text
    assert 'gateway_service_count{function_name="counted.openfaas-fn"} 1.0' in text


def test_provider_endpoints_for_a_real_openfaas_gateway_in_front(tmp_path):
    running = Running(tmp_path, provider_port=0)
    try:
        provider = f"http://127.0.0.1:{running.system.provider_port}"
        info = requests.get(f"{provider}/system/info", auth=running.auth, timeout=5).json()
        assert PROVIDER_INFO["required"] <= info.keys() and isinstance(info["provider"], str)
        assert VERSION_INFO["required"] <= info["version"].keys()
        assert requests.get(f"{provider}/system/functions", timeout=5).status_code == 401
        res = requests.post(f"{provider}/system/functions", json=faas_cli_deploy_body("via-provider"),
                            auth=running.auth, timeout=10)
        assert res.status_code == 202
        running.wait_available("via-provider", 1)  # the same registry behind both listeners
        res = requests.post(f"{provider}/function/via-provider", data=b"p", timeout=10)
        assert res.status_code == 200 and res.content == b"p"
    finally:
        running.close()


def test_a_killed_replica_is_replaced_and_gets_no_traffic(gw):
    import signal

    assert gw.deploy(faas_cli_deploy_body("phoenix")).status_code == 202
    gw.wait_available("phoenix", 1)
    [old] = gw.call(gw.system.gateway.hosts["host-0"].replicas())
    os.kill(old.pid, signal.SIGKILL)
    time.sleep(0.01)
    # the request meets a refused connection, is held, and goes to the replacement replica
    res = requests.post(f"{gw.url}/function/phoenix", data=b"at once", timeout=30)
    assert res.status_code == 200 and res.content == b"at once", res.text
    deadline = time.monotonic() + 30
    while True:
        reps = [r for r in gw.replicas("phoenix")["replicas"] if r["state"] == "ready"]
        if reps and all(r["id"] != old.id for r in reps):
            break
        assert time.monotonic() < deadline, reps
        time.sleep(0.05)
    res = requests.post(f"{gw.url}/function/phoenix", data=b"again", timeout=10)
    assert res.status_code == 200 and res.content == b"again"
