"""``POST /async-function/{name}``: 202 + X-Call-Id, the call runs later, its result goes to X-Callback-Url."""

from __future__ import annotations

import time

import requests
from support.callbacks import deploy_function, wait_available
from support.embedded_system import ThreadedSystem


def test_async_call_is_accepted_then_calls_back_with_the_result(tmp_path, callbacks):
    system = ThreadedSystem(tmp_path)
    try:
        deploy_function(system, "echo")
        wait_available(system, "echo")
        res = requests.post(f"{system.url}/async-function/echo/sub/path?x=1", data=b"hello async",
                            headers={"X-Callback-Url": callbacks.url, "Content-Type": "text/plain"}, timeout=10)
        assert res.status_code == 202 and res.content == b"", res.text
        call_id = res.headers["X-Call-Id"]
        headers, body = callbacks.next()
        assert body == b"hello async"
        assert headers["X-Call-Id"] == call_id and headers["X-Function-Name"] == "echo"
        assert headers["X-Function-Status"] == "200" and float(headers["X-Duration-Seconds"]) >= 0
        # the same call through the namespace-qualified name, without a callback: accepted, runs, nobody told
        res = requests.post(f"{system.url}/async-function/echo.openfaas-fn", data=b"x", timeout=10)
        assert res.status_code == 202
        deadline = time.monotonic() + 10
        while not all(line in (metrics := requests.get(f"{system.url}/metrics", timeout=10).text) for line in (
                'quart_async_calls_total{outcome="completed"} 2.0', "quart_async_queue_length 0.0")):
            assert time.monotonic() < deadline, f"the async call without a callback never completed: {metrics}"
            time.sleep(0.05)
        assert 'quart_async_calls_total{outcome="accepted"} 2.0' in metrics
        listing = requests.get(f"{system.url}/system/functions", auth=system.auth, timeout=10).json()
        assert listing[0]["invocationCount"] == 2  # both ran through /function/echo
    finally:
        system.close()


def test_async_call_errors_name_what_is_wrong(tmp_path):
    system = ThreadedSystem(tmp_path)
    try:
        deploy_function(system, "echo")
        res = requests.get(f"{system.url}/async-function/echo", timeout=10)
        assert res.status_code == 405 and res.headers["Allow"] == "POST"
        res = requests.post(f"{system.url}/async-function/nope", data=b"x", timeout=10)
        assert res.status_code == 404 and "nope" in res.json()["error"]
        res = requests.post(f"{system.url}/async-function/echo.other-ns", data=b"x", timeout=10)
        assert res.status_code == 404 and res.json()["field"] == "namespace"
        res = requests.post(f"{system.url}/async-function/echo", data=b"x",
                            headers={"X-Callback-Url": "ftp://example/x"}, timeout=10)
        assert res.status_code == 400 and res.json()["field"] == "X-Callback-Url"
        assert requests.get(f"{system.url}/healthz", timeout=10).status_code == 200  # still serving
    finally:
        system.close()


def test_a_full_async_queue_answers_429(tmp_path, callbacks):
    system = ThreadedSystem(tmp_path, async_workers=1, async_queue_cap=1)
    try:
        deploy_function(system, "echo")
        wait_available(system, "echo")
        callbacks.release.clear()  # the first call stays in the stream until its callback is answered
        post = lambda body: requests.post(f"{system.url}/async-function/echo", data=body,  # noqa: E731
                                          headers={"X-Callback-Url": callbacks.url}, timeout=10)
        assert post(b"first").status_code == 202
        assert callbacks.next()[1] == b"first"  # held in that callback, not yet acked
        full = post(b"second")
        assert full.status_code == 429 and full.headers["Retry-After"] and "queue" in full.json()["error"]
        callbacks.release.set()
        deadline = time.monotonic() + 10
        while (res := post(b"third")).status_code == 429:  # acked: room again
            assert time.monotonic() < deadline, res.text
            time.sleep(0.05)
        assert res.status_code == 202 and callbacks.next()[1] == b"third"
    finally:
        callbacks.release.set()
        system.close()


def test_an_async_call_to_a_model_goes_through_the_pipeline(tmp_path, callbacks, monkeypatch):
    monkeypatch.setenv("QUART_POLICY", "static")
    monkeypatch.setenv("QUART_RECORDS", str(tmp_path / "records.jsonl"))
    system = ThreadedSystem(tmp_path, attach_plugin=True)
    try:
        for i in range(2):
            deploy_function(system, f"m-stage-{i}", **{"com.quart.model": "m", "com.quart.stage": str(i),
                                              "com.quart.stages": "2", "com.openfaas.scale.min": "1"})
        for i in range(2):
            wait_available(system, f"m-stage-{i}")
        res = requests.post(f"{system.url}/async-function/m", data=b"through both stages",
                            headers={"X-Callback-Url": callbacks.url}, timeout=10)
        assert res.status_code == 202, res.text
        headers, body = callbacks.next()
        assert (headers["X-Function-Status"], body) == ("200", b"through both stages")
        assert headers["X-Function-Name"] == "m" and headers["X-Call-Id"] == res.headers["X-Call-Id"]
        listing = requests.get(f"{system.url}/system/functions", auth=system.auth, timeout=10).json()
        assert {f["name"]: f["invocationCount"] for f in listing} == {"m-stage-0": 1, "m-stage-1": 1}
    finally:
        system.close()
