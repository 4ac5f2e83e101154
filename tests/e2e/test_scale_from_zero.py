"""Scale from zero for a pipeline, as the OpenFaaS gateway does it for a function: a call on
``/function/<model>`` whose stages have ``com.openfaas.scale.min: 0`` starts them and is answered within its
deadline; and nothing but a call undoes a scale to zero."""

from __future__ import annotations

import time

import requests
from support.embedded_system import ThreadedSystem, deploy_echo_pipeline, plugin_system


def replicas(system: ThreadedSystem, name: str) -> tuple[int, int]:
    doc = requests.get(f"{system.url}/system/function/{name}", auth=system.auth, timeout=10).json()
    return doc["replicas"], doc["availableReplicas"]


def test_a_scale_min_0_model_answers_its_first_pipeline_call_and_stays_at_zero_until_called(tmp_path, monkeypatch):
    system = plugin_system(tmp_path, monkeypatch, "0.1")
    try:
        deploy_echo_pipeline(system, "z", 2, **{"com.openfaas.scale.min": "0", "com.openfaas.scale.max": "4"})
        time.sleep(1.0)  # ten control periods with no call: nothing starts
        assert [replicas(system, f"z-stage-{i}") for i in range(2)] == [(0, 0), (0, 0)]
        started = time.monotonic()
        res = requests.post(f"{system.url}/function/z", data=b"first call", timeout=30,
                            headers={"X-Quart-Timeout-Ms": "20000"})
        took = time.monotonic() - started
        assert (res.status_code, res.content) == (200, b"first call"), res.text
        assert took < 20, took
        assert all(replicas(system, f"z-stage-{i}")[1] >= 1 for i in range(2))
        # an operator's scale to zero holds: the controller does not bring the stages back without a call
        for i in range(2):
            res = requests.post(f"{system.url}/system/scale-function/z-stage-{i}",
                                json={"serviceName": f"z-stage-{i}", "replicas": 0}, auth=system.auth, timeout=10)
            assert res.status_code in (200, 202), res.text
        time.sleep(1.5)
        assert [replicas(system, f"z-stage-{i}")[0] for i in range(2)] == [0, 0]
        res = requests.post(f"{system.url}/function/z", data=b"again", timeout=30)
        assert (res.status_code, res.content) == (200, b"again"), res.text
    finally:
        system.close()
