"""Issue 31 items 5 and 6 (auth): no 500 from a malformed encoding or number; names others own and caps.

A ``Content-Encoding: gzip`` body that is not gzip gave 500 on ``/async-function/*`` and ``/system/*``,
``{"replicas": 1e400}`` an ``OverflowError``; a deploy could take a model's or the plugin's
``/function/<name>``, and nothing capped the functions, labels or label sizes; ``basic`` (lower case)
was refused though RFC 7617 makes the scheme case-insensitive.
"""

from __future__ import annotations

import base64

import pytest
import requests
from quart_provider.deploy_limits import DeployCaps, check_labels, check_model, check_name
from quart_stage.errors import QuartError
from support.faas_cli import Running, faas_cli_deploy_body

GZIP = {"Content-Encoding": "gzip"}


def test_a_body_that_is_not_the_gzip_it_claims_is_a_400_naming_content_encoding(gw):
    quiet = {"com.openfaas.scale.min": "0", "com.openfaas.scale.max": "1"}
    assert gw.deploy(faas_cli_deploy_body("echo", labels=quiet)).status_code == 202
    for method, path in [("POST", "/async-function/echo"), ("POST", "/system/functions"),
                         ("PUT", "/system/functions"), ("POST", "/system/scale-function/echo")]:
        r = requests.request(method, gw.url + path, data=b"not gzip at all", headers=GZIP, auth=gw.auth, timeout=10)
        assert r.status_code == 400 and r.json()["field"] == "Content-Encoding", (path, r.text)


def test_a_number_too_large_for_a_float_is_a_400(gw):
    r = requests.post(f"{gw.url}/system/scale-function/echo", data=b'{"serviceName": "echo", "replicas": 1e400}',
                      auth=gw.auth, timeout=10)
    assert r.status_code == 400 and "out of range" in r.json()["error"]


def test_the_basic_scheme_is_case_insensitive(gw):
    token = base64.b64encode(f"{gw.auth[0]}:{gw.auth[1]}".encode()).decode()
    for scheme in ("basic", "BASIC", "Basic"):
        r = requests.get(f"{gw.url}/system/functions", headers={"Authorization": f"{scheme} {token}"}, timeout=10)
        assert r.status_code == 200, scheme
    assert requests.get(f"{gw.url}/system/functions", headers={"Authorization": f"Bearer {token}"},
                        timeout=10).status_code == 401


def test_a_model_or_plugin_name_is_refused_409_naming_its_owner():
    pipelines = {"bert": ["bert-stage-0", "bert-stage-1"]}
    with pytest.raises(QuartError) as err:
        check_name("bert", pipelines, {})
    assert err.value.status == 409 and "pipeline of model 'bert'" in err.value.message
    with pytest.raises(QuartError) as err:
        check_name("quart-plugin", pipelines, {"quart-plugin": "the QUART plugin"})
    assert err.value.status == 409 and "the QUART plugin" in err.value.message
    check_name("bert-stage-0", pipelines, {})  # a stage of the model is its own function
    with pytest.raises(QuartError) as err:
        check_model("echo", ["echo"], {})  # a stage of model "echo" while a function answers /function/echo
    assert err.value.status == 409 and err.value.field == "labels.com.quart.model"
    check_model("bert", ["echo"], {})


def test_the_plugin_route_is_reserved_on_a_gateway_with_the_plugin(tmp_path):
    running = Running(tmp_path, attach_plugin=True)
    try:
        r = running.deploy(faas_cli_deploy_body("quart-plugin"))
        assert r.status_code == 409 and "QUART plugin" in r.json()["error"], r.text
    finally:
        running.close()


def test_label_caps_name_the_limit():
    caps = DeployCaps(10, 2, 16)
    check_labels({"a": "1", "b": "2"}, caps)
    with pytest.raises(QuartError) as err:
        check_labels({"a": "1", "b": "2", "c": "3"}, caps)
    assert err.value.status == 400 and "QUART_GATEWAY_MAX_LABELS" in err.value.message
    with pytest.raises(QuartError) as err:
        check_labels({"a": "x" * 16}, caps)
    assert err.value.field == "labels.a" and "QUART_GATEWAY_MAX_LABEL_BYTES" in err.value.message


def test_functions_per_namespace_and_labels_are_capped_over_http(tmp_path):
    running = Running(tmp_path, max_functions=2, max_labels=4, max_label_bytes=64)
    try:
        quiet = {"com.openfaas.scale.min": "0", "com.openfaas.scale.max": "1"}
        for name in ("f1", "f2"):
            assert running.deploy(faas_cli_deploy_body(name, labels=quiet)).status_code == 202
        r = running.deploy(faas_cli_deploy_body("f3", labels=quiet))
        assert r.status_code == 409 and "QUART_GATEWAY_MAX_FUNCTIONS" in r.json()["error"]
        big = {**quiet, "x": "y" * 100}
        r = requests.put(f"{running.url}/system/functions", json=faas_cli_deploy_body("f1", labels=big),
                         auth=running.auth, timeout=10)
        assert r.status_code == 400 and r.json()["field"] == "labels.x"
    finally:
        running.close()
