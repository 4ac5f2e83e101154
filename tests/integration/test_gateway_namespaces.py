"""faas-cli's namespace suffix everywhere: ``/function/<name>.<namespace>`` and ``/async-function/...`` for
functions and pipelines (embedded and standalone plugin); an unknown namespace is a 404 (spec.openapi.yml)."""

from __future__ import annotations

import requests
from support.callbacks import deploy_function, wait_available
from support.embedded_system import ThreadedSystem


def test_namespace_suffix_for_functions_and_pipelines(tmp_path, callbacks, monkeypatch):  # noqa: F811
    monkeypatch.setenv("QUART_POLICY", "static")
    monkeypatch.setenv("QUART_RECORDS", str(tmp_path / "records.jsonl"))
    system = ThreadedSystem(tmp_path, attach_plugin=True)
    url, auth = system.url, system.auth
    try:
        deploy_function(system, "echo")
        for i in range(2):
            deploy_function(system, f"m-stage-{i}", **{"com.quart.model": "m", "com.quart.stage": str(i),
                                              "com.quart.stages": "2", "com.openfaas.scale.min": "1"})
        for name in ("echo", "m-stage-0", "m-stage-1"):
            wait_available(system, name)
        for target in ("echo", "m"):
            res = requests.post(f"{url}/function/{target}.openfaas-fn", data=b"hi", timeout=20)
            assert (res.status_code, res.content) == (200, b"hi"), res.text
            res = requests.post(f"{url}/function/{target}.elsewhere", data=b"hi", timeout=20)
            assert res.status_code == 404 and res.json()["field"] == "namespace"
            res = requests.post(f"{url}/async-function/{target}.openfaas-fn", data=b"later", timeout=10,
                                headers={"X-Callback-Url": callbacks.url})
            assert res.status_code == 202, res.text
            headers, body = callbacks.next()
            assert (headers["X-Function-Status"], body) == ("200", b"later")
            res = requests.post(f"{url}/async-function/{target}.elsewhere", data=b"x", timeout=10)
            assert res.status_code == 404 and res.json()["field"] == "namespace"

        # /system/*: the namespace as faas-cli sends it (query or body); another one is a 404
        assert requests.get(f"{url}/system/function/echo?namespace=openfaas-fn", auth=auth, timeout=5).ok
        for method, path, body in (
            ("GET", "/system/function/echo?namespace=elsewhere", None),
            ("GET", "/system/functions?namespace=elsewhere", None),
            ("DELETE", "/system/functions", {"functionName": "echo", "namespace": "elsewhere"}),
            ("POST", "/system/scale-function/echo", {"serviceName": "echo", "replicas": 2, "namespace": "elsewhere"}),
            ("GET", "/system/namespace/elsewhere", None),
        ):
            res = requests.request(method, url + path, json=body, auth=auth, timeout=5)
            assert res.status_code == 404 and res.json()["field"] == "namespace", (path, res.text)
        res = requests.get(f"{url}/system/namespace/openfaas-fn", auth=auth, timeout=5)
        assert res.status_code == 200 and res.json()["name"] == "openfaas-fn"
        assert requests.get(f"{url}/system/namespace/openfaas-fn", timeout=5).status_code == 401
    finally:
        system.close()


def test_standalone_plugin_takes_the_namespace_suffix(setup):  # noqa: F811
    res = requests.post(f"{setup.url}/function/m.openfaas-fn", data=b"x", timeout=30)
    assert (res.status_code, res.content) == (200, b"x"), res.text
    res = requests.post(f"{setup.url}/function/m.elsewhere", data=b"x", timeout=30)
    assert res.status_code == 404 and res.json()["field"] == "namespace"
    assert res.headers["X-Call-Id"]
    res = requests.post(f"{setup.url}/function/nope.openfaas-fn", data=b"x", timeout=30)
    assert res.status_code == 404 and "nope" in res.json()["error"]
