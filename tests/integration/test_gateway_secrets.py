"""/system/secrets as faas-cli's proxy/secret.go calls it; secrets stored 0600 and given to replicas as files."""

from __future__ import annotations

import base64
import logging
import stat
import time
from pathlib import Path

import requests
from support.chunked_http import chunked_json
from support.faas_cli import faas_cli_deploy_body

VALUE = "s3cr3t-value-7f1c"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secret_list_create_update_remove_like_faas_cli(gw, caplog):
    caplog.set_level(logging.DEBUG)
    url, auth = f"{gw.url}/system/secrets", gw.auth
    assert requests.get(url, auth=auth, timeout=5).json() == []
    assert requests.get(url, timeout=5).status_code == 401
    res = requests.post(url, json={"name": "api-key", "namespace": "openfaas-fn", "value": VALUE}, auth=auth,
                        timeout=5)
    assert res.status_code == 201, res.text
    again = requests.post(url, json={"name": "api-key", "value": VALUE}, auth=auth, timeout=5)
    assert again.status_code == 409 and VALUE not in again.text
    assert requests.get(url, params={"namespace": "openfaas-fn"}, auth=auth, timeout=5).json() == [
        {"name": "api-key", "namespace": "openfaas-fn"}]
    stored = gw.system.config.function_secrets_dir / "openfaas-fn" / "api-key"
    assert stored.read_text() == VALUE and mode(stored) == 0o600 and mode(stored.parent) == 0o700
    assert mode(stored.parent.parent) == 0o700

    binary = bytes(range(256))
    res = requests.put(url, json={"name": "api-key", "rawValue": base64.b64encode(binary).decode()}, auth=auth,
                       timeout=5)
    assert res.status_code == 200 and stored.read_bytes() == binary and mode(stored) == 0o600
    status, _ = chunked_json(gw.url, "POST", "/system/secrets", {"name": "db.password", "value": "x" * 9000},
                             pieces=5, auth=auth)
    assert status == 201
    assert [s["name"] for s in requests.get(url, auth=auth, timeout=5).json()] == ["api-key", "db.password"]

    for method, body, code, field in (
        ("PUT", {"name": "nope", "value": "x"}, 404, "name"),
        ("DELETE", {"name": "nope"}, 404, "name"),
        ("POST", {"name": "../escape", "value": "x"}, 400, "name"),
        ("POST", {"value": "x"}, 400, "name"),
        ("POST", {"name": "b64", "rawValue": "not base64!"}, 400, "rawValue"),
        ("POST", {"name": "elsewhere", "namespace": "other", "value": "x"}, 404, "namespace"),
    ):
        res = requests.request(method, url, json=body, auth=auth, timeout=5)
        assert (res.status_code, res.json()["field"]) == (code, field), (body, res.text)
    assert requests.get(url, params={"namespace": "other"}, auth=auth, timeout=5).status_code == 404

    res = requests.delete(url, json={"name": "db.password", "namespace": "openfaas-fn"}, auth=auth, timeout=5)
    assert res.status_code == 200
    assert [s["name"] for s in requests.get(url, auth=auth, timeout=5).json()] == ["api-key"]
    assert VALUE not in caplog.text


def replica_env(gw, name: str) -> dict[str, str]:
    host = gw.system.gateway.hosts["host-0"]
    [replica] = [r for r in gw.call(host.replicas()) if r.function == name and r.state != "dead"]
    raw = Path(f"/proc/{replica.pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_a_deploy_gets_its_secrets_as_files_and_a_missing_one_is_refused(gw):
    res = gw.deploy(faas_cli_deploy_body("uses", secrets=["api-key"]))
    assert res.status_code == 400 and res.json()["field"] == "secrets" and "api-key" in res.json()["error"]
    assert requests.post(f"{gw.url}/system/secrets", json={"name": "api-key", "value": VALUE}, auth=gw.auth,
                         timeout=5).status_code == 201
    assert gw.deploy(faas_cli_deploy_body("uses", secrets=["api-key"])).status_code == 202
    status = gw.wait_available("uses", 1)
    assert status["secrets"] == ["api-key"]
    folder = Path(replica_env(gw, "uses")["QUART_SECRETS_DIR"])
    assert (folder / "api-key").read_text() == VALUE
    assert mode(folder) == 0o700 and mode(folder / "api-key") == 0o600
    res = gw.deploy(faas_cli_deploy_body("uses", secrets=["api-key", "other"]))  # an update naming a missing one
    assert res.status_code == 400 and "'other'" in res.json()["error"]
    requests.delete(f"{gw.url}/system/functions", json={"functionName": "uses"}, auth=gw.auth, timeout=10)
    deadline = time.monotonic() + 15
    while folder.exists():  # the replica's copy goes with it
        assert time.monotonic() < deadline, f"{folder} outlived its replica"
        time.sleep(0.05)
