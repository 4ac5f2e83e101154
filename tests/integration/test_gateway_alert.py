"""POST /system/alert as AlertManager sends it: firing scales a function up a step, resolved back to its min."""

from __future__ import annotations

import requests
from quart_provider.handlers_alert import next_replicas


def _alert(status: str, function_name: str) -> dict:
    return {"status": status, "receiver": "scale-up", "alerts": [
        {"status": status, "labels": {"alertname": "APIHighInvocationRate", "function_name": function_name}}]}


def test_calculate_replicas_as_openfaas():
    assert next_replicas("firing", 1, 20, 1, 20) == 5  # a step of ceil(20 / 100 * 20) = 4
    assert next_replicas("firing", 18, 20, 1, 20) == 20  # capped at max
    assert next_replicas("firing", 1, 50, 1, 20) == 5  # max itself capped at 20
    assert next_replicas("firing", 1, 20, 1, 0) == 1  # factor 0: no step
    assert next_replicas("resolved", 9, 20, 2, 20) == 2


def test_alerts_scale_functions(gw):
    body = {"service": "echo", "image": "quart/echo:latest",
            "labels": {"com.openfaas.scale.max": "10", "com.openfaas.scale.factor": "30"}}
    assert gw.deploy(body).status_code == 202
    url = f"{gw.url}/system/alert"
    res = requests.post(url, json=_alert("firing", "echo.openfaas-fn"), auth=gw.auth, timeout=10)
    assert res.status_code == 200 and res.json() == {"scaled": {"echo": 4}}  # 1 + ceil(10 / 100 * 30)
    assert gw.describe("echo").json()["replicas"] == 4
    res = requests.post(url, json=_alert("resolved", "echo"), auth=gw.auth, timeout=10)
    assert res.json() == {"scaled": {"echo": 1}} and gw.describe("echo").json()["replicas"] == 1
    for other in ("nope", "echo.elsewhere"):  # skipped, as OpenFaaS skips them
        res = requests.post(url, json=_alert("firing", other), auth=gw.auth, timeout=10)
        assert res.status_code == 200 and res.json() == {"scaled": {}}
    res = requests.post(url, json={"alerts": [{"status": "firing", "labels": {}}]}, auth=gw.auth, timeout=10)
    assert res.status_code == 400 and res.json()["field"] == "alerts[0].labels.function_name"
    assert requests.post(url, json=_alert("firing", "echo"), timeout=10).status_code == 401
