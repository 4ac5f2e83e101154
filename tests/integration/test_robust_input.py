"""Issue 14 item 5 and the deploy half of item 4: every bad input a 4xx naming the field.

Reproducers from the issue: ``input_ids`` of 2**70, JSON nested 5,000 deep, a nested safetensors
header, deep nesting and ``"replicas": NaN`` on the deploy and scale APIs, a deploy labelled
``com.quart.stage: "abc"``, ``limits.cpu`` of nan/inf, ``envVars`` that run code in the interpreter
(``PYTHONWARNINGS`` + ``BROWSER`` …), a manifest whose ``file`` points outside the model folder.
"""

from __future__ import annotations

import json
import struct

import pytest
import requests
import torch
from quart_stage import envpolicy, jsonparse, wire
from quart_stage.config import StageConfig
from quart_stage.errors import QuartError
from quart_stage.manifest import Manifest, stage_path
from quart_stage.runtime import StageRuntime
from support.faas_cli import faas_cli_deploy_body

DEEP = b"[" * 5000 + b"]" * 5000


@pytest.mark.parametrize("raw, words", [
    (b'{"a": ' + DEEP + b"}", "deep"),
    (b'{"replicas": NaN}', "NaN"),
    (b'{"replicas": -Infinity}', "Infinity"),
    (b'{"n": ' + b"9" * 5000 + b"}", "valid JSON"),
    (b'{"a": "\xff"}', "UTF-8"),
    (b"[1]", "object"),
    (b"  ", "empty"),
])
def test_json_helper_refuses_with_a_400_naming_the_field(raw, words):
    with pytest.raises(QuartError) as err:
        jsonparse.loads_object(raw, "body")
    assert err.value.status == 400 and err.value.field == "body" and words in err.value.message


def test_json_helper_keeps_plain_documents_and_brackets_in_strings():
    assert jsonparse.loads_object(b'{"a": [[1, 2]], "s": "' + b"[" * 500 + b'"}')["a"] == [[1, 2]]
    assert jsonparse.nesting_depth('{"a": [[1]], "b": "[[[["}') == 3


def test_deploy_and_scale_apis_answer_400_to_deep_nesting_nan_and_bad_labels(gw):
    assert gw.deploy(faas_cli_deploy_body("steady")).status_code == 202
    gw.wait_available("steady", 1)
    post = lambda path, data: requests.post(f"{gw.url}{path}", data=data, auth=gw.auth, timeout=10)  # noqa: E731
    for path in ("/system/functions", "/system/scale-function/steady", "/system/secrets"):
        res = post(path, b'{"a": ' + DEEP + b"}")
        assert res.status_code == 400 and res.json()["field"] == "body", (path, res.text)
    res = post("/system/scale-function/steady", b'{"serviceName": "steady", "replicas": NaN}')
    assert res.status_code == 400 and res.json()["field"] == "body"
    res = requests.put(f"{gw.url}/system/functions", data=b'{"service": "steady", "image": "quart/echo", '
                       b'"labels": {"com.openfaas.scale.min": NaN}}', auth=gw.auth, timeout=10)
    assert res.status_code == 400 and res.json()["field"] == "body"

    bad = faas_cli_deploy_body("bad-stage", labels={"com.quart.model": "m", "com.quart.stage": "abc"})
    res = gw.deploy(bad)
    assert res.status_code == 400 and res.json()["field"] == "labels.com.quart.stage"
    res = gw.deploy(faas_cli_deploy_body("bad-prof", labels={"com.quart.profile-ms": "nan"}))
    assert res.status_code == 400 and res.json()["field"] == "labels.com.quart.profile-ms"
    for cpu in ("nan", "inf", "-1", "1e9"):
        res = gw.deploy(faas_cli_deploy_body("bad-cpu", limits={"cpu": cpu}))
        assert res.status_code == 400 and res.json()["field"] == "limits.cpu", cpu
    res = gw.deploy(faas_cli_deploy_body("bad-mem", limits={"memory": "9" * 400 + "Ei"}))
    assert res.status_code == 400 and res.json()["field"] == "limits.memory"

    assert [f["name"] for f in requests.get(f"{gw.url}/system/functions", auth=gw.auth, timeout=5).json()] == ["steady"]
    res = requests.post(f"{gw.url}/function/steady", data=b"still here", timeout=5)
    assert res.status_code == 200 and res.content == b"still here"
    assert requests.post(f"{gw.url}/function/m", data=b"{}", timeout=5).status_code == 404  # no half pipeline


@pytest.mark.parametrize("name", ["PYTHONWARNINGS", "BROWSER", "PYTHONSTARTUP", "PYTHONPATH", "PYTHONHOME",
                                  "LD_PRELOAD", "LD_LIBRARY_PATH", "GLIBC_TUNABLES", "GCONV_PATH", "PATH",
                                  "QUART_KEYSMANAGER_SOCKET", "QUART_SECRETS_DIR", "pythonwarnings", "A-B"])
def test_deploy_env_that_runs_code_in_the_interpreter_is_refused(name):
    with pytest.raises(QuartError) as err:
        envpolicy.check_deploy_env({name: "x"})
    assert err.value.status == 400 and err.value.field.startswith("envVars")


def test_deploy_env_rule_over_http_and_what_stays_allowed(gw):
    res = gw.deploy(faas_cli_deploy_body("env", envVars={"PYTHONWARNINGS": "ignore::x.y", "BROWSER": "touch /tmp/p"}))
    assert res.status_code == 400 and res.json()["field"] == "envVars.PYTHONWARNINGS"
    res = gw.deploy(faas_cli_deploy_body("env", envVars={"A": "nul\x00byte"}))
    assert res.status_code == 400 and res.json()["field"] == "envVars.A"
    ok = {"QUART_MODEL_DIR": "/m", "QUART_COMPUTE": "cpu", "OMP_NUM_THREADS": "2", "write_debug": "false"}
    assert envpolicy.check_deploy_env(ok) == ok


def test_replicas_do_not_inherit_the_hosts_credentials():
    host = {"PATH": "/bin", "AWS_SECRET_ACCESS_KEY": "k", "QUART_GATEWAY_PORT": "1", "GITHUB_TOKEN": "t",
            "DB_PASSWORD": "p", "LANG": "C.UTF-8", "KEYSMANAGER_TOKEN_FILE": "/x"}
    assert envpolicy.replica_base_env(host) == {"PATH": "/bin", "LANG": "C.UTF-8"}


def test_stage_answers_400_to_huge_ids_deep_json_and_a_nested_header(tiny1):
    rt = StageRuntime.load(StageConfig(model_dir=tiny1, stage_index=0, num_stages=1))
    js = {"Content-Type": "application/json"}
    cases = [
        (json.dumps({"input_ids": [[2**70, 1]]}).encode(), js, "input_ids"),
        (b'{"input_ids": ' + DEEP + b"}", js, "body"),
        (b'{"input_ids": [[NaN]]}', js, "body"),
    ]
    header = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    cases.append((struct.pack("<Q", len(header)) + header, {"Content-Type": wire.CONTENT_TYPE}, "body"))
    for body, headers, field in cases:
        res = rt.handle(body, headers)
        assert res.status == 400 and json.loads(res.body)["field"] == field, res.body[:200]
    good = rt.handle(json.dumps({"input_ids": [[1, 2, 3]]}).encode(), js)
    assert good.status == 200


def test_manifest_file_outside_the_model_folder_is_refused(tiny1, tmp_path):
    doc = json.loads(Manifest.load(tiny1).to_json())
    for bad in ("/etc/passwd", "../../etc/passwd", "a/../../x"):
        doc["stages"][0]["file"] = bad
        with pytest.raises(ValueError, match="inside the model folder"):
            Manifest.from_dict(doc)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "link").symlink_to("/etc/passwd")
    with pytest.raises(ValueError, match="outside the model folder"):
        stage_path(tmp_path / "m", "link")
    assert stage_path(tiny1, Manifest.load(tiny1).stage(0).file).startswith(tiny1)


def test_stage_input_ids_of_two_to_the_seventy_are_a_400_over_safetensors(tiny1):
    rt = StageRuntime.load(StageConfig(model_dir=tiny1, stage_index=0, num_stages=1))
    body = wire.encode_bytes({"input_ids": torch.tensor([[2**62, 1]])})
    res = rt.handle(body, {"Content-Type": wire.CONTENT_TYPE})
    assert res.status == 400 and json.loads(res.body)["field"] == "input_ids"


def test_router_retries_only_what_another_replica_can_fix():
    from quart_transport.retry import passed_on, should_retry
    from quart_transport.upstream import UpstreamError, UpstreamRefused, UpstreamTimeout

    assert should_retry(0, ConnectionRefusedError()) and should_retry(0, UpstreamRefused("refused"))
    assert should_retry(0, UpstreamTimeout("late")) and should_retry(0, UpstreamError("died mid-answer"))
    assert not should_retry(0, RuntimeError("the router's HTTP client is closed"))
    for status in (408, 429, 502, 503):
        assert should_retry(status, None) and not passed_on(status, None)
    for status in (400, 404, 413, 415, 422, 500, 501, 504):
        assert not should_retry(status, None) and passed_on(status, None)
    assert not passed_on(200, None) and not passed_on(502, TimeoutError())


@pytest.mark.parametrize("length", [b"-5", b"abc", b"1e3", b"5\r\nContent-Length: 6", b"99999999999999999"])
def test_echo_replica_answers_malformed_content_length_with_400_and_closes(length):
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "quart_provider.echo", "--port", str(port)])
    try:
        import time

        deadline = time.monotonic() + 10
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with sock:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\nhello")
            assert sock.recv(4096).startswith(b"HTTP/1.1 400")
            assert sock.recv(4096) == b""  # closed
        assert requests.post(f"http://127.0.0.1:{port}/", data=b"ok", timeout=5).content == b"ok"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_replica_that_refuses_connections_is_known_dead():
    from quart_transport.retry import replica_gone
    from quart_transport.upstream import UpstreamError, UpstreamRefused

    assert replica_gone(UpstreamRefused("cannot connect to 127.0.0.1:9: refused"))
    assert not replica_gone(UpstreamError("the replica closed the connection")) and not replica_gone(None)


def test_a_refusal_through_aiohttp_s_client_is_known_dead_too():
    """The session engine's aiohttp client wraps a refused connection in ClientConnectorError (found by the pod
    addressing tests: a dead pod still listed was picked again for every new session)."""
    import asyncio
    import socket

    import aiohttp
    from quart_transport.retry import replica_gone

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def refused() -> BaseException:
        async with aiohttp.ClientSession() as client:
            try:
                await client.post(f"http://127.0.0.1:{port}/", data=b"x")
            except aiohttp.ClientError as exc:
                return exc
        raise AssertionError("a connection to a closed port was accepted")

    error = asyncio.run(refused())
    assert isinstance(error, aiohttp.ClientConnectorError) and replica_gone(error)
    assert not replica_gone(aiohttp.ServerDisconnectedError())
