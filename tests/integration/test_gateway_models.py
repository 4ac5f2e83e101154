"""A model as one function for an unmodified OpenFaaS gateway in front (scale_from_zero=true): the calls it
makes on the provider API - status, scale from zero, wait for availableReplicas, proxy /function/<model>."""

from __future__ import annotations

import time

import requests
from support.embedded_system import ThreadedSystem


def test_the_gateway_scales_a_model_from_zero_and_invokes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("QUART_POLICY", "static")
    monkeypatch.setenv("QUART_RECORDS", str(tmp_path / "records.jsonl"))
    system = ThreadedSystem(tmp_path, attach_plugin=True, provider_port=0)
    provider = f"http://127.0.0.1:{system.system.provider_port}"
    try:
        for i in range(2):
            body = {"service": f"m-stage-{i}", "image": "quart/echo:latest",
                    "labels": {"com.quart.model": "m", "com.quart.stage": str(i), "com.quart.stages": "2",
                               "com.openfaas.scale.min": "0"}}
            assert requests.post(f"{system.url}/system/functions", json=body, auth=system.auth,
                                 timeout=30).status_code == 202
        status = lambda: requests.get(f"{provider}/system/function/m", params={"namespace": "openfaas-fn"},  # noqa: E731
                                      auth=system.auth, timeout=10)
        res = status()  # what the OpenFaaS gateway asks before it proxies /function/m
        assert res.status_code == 200, res.text
        doc = res.json()
        assert (doc["name"], doc["availableReplicas"], doc["replicas"], doc["status"]) == ("m", 0, 0, "Not Ready")
        assert doc["labels"]["com.quart.model"] == "m" and doc["labels"]["com.quart.stages"] == "2"
        assert doc["annotations"]["com.quart.stage-functions"] == "m-stage-0,m-stage-1"
        assert "stage 0 (m-stage-0): scaled to zero" in doc["reason"]
        # scale from zero, as the gateway does it, then poll until the model is available
        res = requests.post(f"{provider}/system/scale-function/m", json={"serviceName": "m", "replicas": 1},
                            auth=system.auth, timeout=10)
        assert res.status_code == 202, res.text
        deadline = time.monotonic() + 20
        while (doc := status().json())["availableReplicas"] < 1:
            assert time.monotonic() < deadline, doc
            time.sleep(0.05)
        assert doc["status"] == "Ready" and "reason" not in doc and doc["replicas"] == 1
        res = requests.post(f"{provider}/function/m", data=b"through both stages", timeout=20)
        assert (res.status_code, res.content) == (200, b"through both stages")
        assert status().json()["invocationCount"] == 1
        # a model is not a deployed function: not listed, and unknown names stay 404
        names = [f["name"] for f in requests.get(f"{provider}/system/functions", auth=system.auth, timeout=10).json()]
        assert sorted(names) == ["m-stage-0", "m-stage-1"]
        assert requests.get(f"{provider}/system/function/nomodel", auth=system.auth, timeout=10).status_code == 404
        # the idler's scale to zero reaches every stage
        assert requests.post(f"{provider}/system/scale-function/m", json={"serviceName": "m", "replicas": 0},
                             auth=system.auth, timeout=10).status_code == 202
        assert status().json()["replicas"] == 0
    finally:
        system.close()
