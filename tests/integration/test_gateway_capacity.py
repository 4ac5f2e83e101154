"""Deploys that cannot run say why (issue 18 item 4): a 400 when they never could, else the reason in the
function's status and in the 503 an invocation gets at once; never a silent Not Ready."""

from __future__ import annotations

import json
import time

import requests
from support.embedded_system import ThreadedSystem


def _deploy(system: ThreadedSystem, name: str, **extra) -> requests.Response:
    body = {"service": name, "image": "quart/echo:latest", **extra}
    return requests.post(f"{system.url}/system/functions", json=body, auth=system.auth, timeout=30)


def _describe(system: ThreadedSystem, name: str) -> dict:
    return requests.get(f"{system.url}/system/function/{name}", auth=system.auth, timeout=10).json()


def _wait(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_deploys_that_can_never_run_are_refused_with_the_reason(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "manifest.json").write_text(json.dumps({"stages": []}))
    system = ThreadedSystem(tmp_path, gpus_per_host=4)  # process hosts: no KeysManager runs stages
    try:
        res = _deploy(system, "stage", image="example/stage:1", envVars={"QUART_MODEL_DIR": str(model)})
        assert res.status_code == 400 and res.json()["field"] == "image" and "KeysManager" in res.json()["error"]
        res = _deploy(system, "wide", labels={"com.openfaas.scale.min": "5"})
        assert res.status_code == 400 and res.json()["field"] == "labels.com.openfaas.scale.min"
        assert "4 replica slot(s)" in res.json()["error"]
        res = _deploy(system, "nope", image="example/unknown:1")
        assert res.status_code == 400 and res.json()["field"] == "image" and "cannot resolve" in res.json()["error"]
        listing = requests.get(f"{system.url}/system/functions", auth=system.auth, timeout=10).json()
        assert listing == []  # nothing half-deployed
    finally:
        system.close()


def test_a_function_without_a_free_slot_says_so_and_runs_once_one_frees(tmp_path):
    system = ThreadedSystem(tmp_path, gpus_per_host=2, ready_wait_s=30)
    try:
        for name in ("a", "b"):
            assert _deploy(system, name).status_code == 202
        _wait(lambda: all(_describe(system, n)["availableReplicas"] == 1 for n in ("a", "b")), "a and b ready")
        assert _describe(system, "a")["status"] == "Ready" and "reason" not in _describe(system, "a")
        assert _deploy(system, "c").status_code == 202  # others may scale down: accepted, and it says why it waits
        _wait(lambda: "reason" in _describe(system, "c") and "slot" in _describe(system, "c")["reason"], "c's reason")
        status = _describe(system, "c")
        assert status["status"] == "Not Ready" and "a (1)" in status["reason"] and "b (1)" in status["reason"]
        assert status["annotations"]["com.quart.not-ready"] == status["reason"]  # what faas-cli describe prints
        started = time.monotonic()
        res = requests.post(f"{system.url}/function/c", data=b"x", timeout=30)
        assert res.status_code == 503 and "slot" in res.json()["error"], res.text
        assert time.monotonic() - started < 5, "the invocation waited out ready_wait_s instead of saying why"
        assert res.headers["Retry-After"]
        requests.delete(f"{system.url}/system/functions", json={"functionName": "a"}, auth=system.auth, timeout=10)
        _wait(lambda: _describe(system, "c")["availableReplicas"] == 1, "c ready once a slot freed")
        status = _describe(system, "c")
        assert status["status"] == "Ready" and "reason" not in status and "com.quart.not-ready" not in status["annotations"]
        assert requests.post(f"{system.url}/function/c", data=b"x", timeout=30).content == b"x"
    finally:
        system.close()
