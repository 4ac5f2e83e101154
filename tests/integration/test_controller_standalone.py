"""The plugin as its own process in front of an OpenFaaS-compatible gateway: function-level dispatch,
inventory from /system/functions, scaling through the REST actuator (the embedded gateway stands in
for OpenFaaS; replicas are its quart/echo processes)."""

from __future__ import annotations

import time

import requests


def test_standalone_routes_pipeline_and_scales_over_rest(setup) -> None:
    deadline = time.monotonic() + 30
    while True:  # the static policy (2 per stage) scales both stages through POST /system/scale-function
        fns = {f["name"]: f for f in requests.get(f"{setup.system.url}/system/functions",
                                                   auth=(setup.system.credentials.user,
                                                         setup.system.credentials.password), timeout=10).json()}
        if all(fns[f"m-stage-{i}"]["availableReplicas"] == 2 for i in range(2)):
            break
        assert time.monotonic() < deadline, fns
        time.sleep(0.1)
    for k in range(4):
        res = requests.post(f"{setup.url}/function/m", data=f"req {k}".encode(), timeout=10)
        assert res.status_code == 200 and res.content == f"req {k}".encode()
    assert requests.post(f"{setup.url}/function/other", data=b"x", timeout=10).status_code == 404
    deadline = time.monotonic() + 5
    while not setup.plugin.controller.last_snapshots.get("m"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    snap = requests.get(f"{setup.url}/snapshot", timeout=10).json()["m"]
    assert [s["name"] for s in snap["stages"]] == ["m-stage-0", "m-stage-1"]
    assert "quart_stage_replicas" in requests.get(f"{setup.url}/metrics", timeout=10).text


def test_standalone_serves_the_generation_api_and_keeps_one_shot_bodies_on_the_router(setup) -> None:
    """The OpenAI-compatible routes are there; a pipeline with no model folder (echo stages) is no decoder
    the plugin can tokenize for: 400 in each door's error shape, and a one-shot body still passes."""
    assert requests.get(f"{setup.url}/v1/models", timeout=10).json() == {"object": "list", "data": []}
    res = requests.post(f"{setup.url}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=10)
    assert res.status_code == 400 and res.json()["error"]["param"] == "model", res.text
    res = requests.post(f"{setup.url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=10)
    assert res.status_code == 404 and res.json()["error"]["code"] == "model_not_found"
    res = requests.post(f"{setup.url}/v1/embeddings", json={"model": "m", "input": "hi"}, timeout=10)
    assert res.status_code == 400 and res.json()["error"]["param"] == "model", res.text  # served, no pooled model
    assert requests.get(f"{setup.url}/health", timeout=10).status_code == 200
    res = requests.post(f"{setup.url}/function/m", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert res.status_code == 400 and res.json()["field"] == "model", res.text
    deadline = time.monotonic() + 20
    while (res := requests.post(f"{setup.url}/function/m", data=b'{"text": ["one-shot"]}', timeout=20)).status_code != 200:
        assert time.monotonic() < deadline, res.text
        time.sleep(0.1)
    assert res.content == b'{"text": ["one-shot"]}'  # echo stages: the body came back through both
