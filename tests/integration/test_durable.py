"""Issue 14 item 2: deployments and secrets survive a gateway restart (reproducer: `quartctl down`/`up`
→ 0 of 7 functions survived, 1244 × 404)."""

from __future__ import annotations

import json
import stat

import requests
from quart_provider.store import DeploymentStore
from support.faas_cli import Running, faas_cli_deploy_body


def test_functions_scale_and_secrets_survive_a_gateway_restart(tmp_path):
    first = Running(tmp_path)
    try:
        requests.post(f"{first.url}/system/secrets", json={"name": "api-key", "value": "s3cr3t"}, auth=first.auth,
                      timeout=5).raise_for_status()
        assert first.deploy(faas_cli_deploy_body("alpha", secrets=["api-key"])).status_code == 202
        assert first.deploy(faas_cli_deploy_body("beta")).status_code == 202
        assert first.deploy(faas_cli_deploy_body("gone")).status_code == 202
        assert first.scale("beta", 2).status_code == 202
        updated = faas_cli_deploy_body("alpha", secrets=["api-key"], envVars={"write_debug": "true"})
        assert first.deploy(updated).status_code == 200
        assert requests.delete(f"{first.url}/system/functions", json={"functionName": "gone"}, auth=first.auth,
                               timeout=10).status_code == 200
        first.wait_available("beta", 2)
        before = {f["name"]: f for f in requests.get(f"{first.url}/system/functions", auth=first.auth, timeout=5).json()}
    finally:
        first.close()
    folder = tmp_path / "state" / "functions"
    assert sorted(p.name for p in folder.iterdir()) == ["alpha.json", "beta.json"]  # no temporary files left
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700

    second = Running(tmp_path)  # what `quartctl up` on the same state folder does
    try:
        second.wait_available("alpha", 1)
        second.wait_available("beta", 2)
        after = {f["name"]: f for f in requests.get(f"{second.url}/system/functions", auth=second.auth,
                                                   timeout=5).json()}
        assert set(after) == {"alpha", "beta"}
        for name in after:
            for key in ("image", "envVars", "labels", "annotations", "limits", "secrets", "createdAt", "replicas"):
                assert after[name].get(key) == before[name].get(key), (name, key)
        assert after["alpha"]["envVars"] == {"write_debug": "true"}
        names = [s["name"] for s in requests.get(f"{second.url}/system/secrets", auth=second.auth, timeout=5).json()]
        assert names == ["api-key"]
        res = requests.post(f"{second.url}/function/beta", data=b"back", timeout=10)
        assert res.status_code == 200 and res.content == b"back"
    finally:
        second.close()


def test_a_stored_document_that_does_not_validate_is_set_aside_not_lost(tmp_path):
    store = DeploymentStore(tmp_path / "state" / "functions")
    from datetime import UTC, datetime

    store.save("good", faas_cli_deploy_body("good"), 1, datetime.now(UTC))
    store.save("badlabel", faas_cli_deploy_body("badlabel", labels={"com.quart.stage": "abc"}), 1, datetime.now(UTC))
    (store.folder / "torn.json").write_text('{"request": {"service": "torn"')
    running = Running(tmp_path)
    try:
        running.wait_available("good", 1)
        names = [f["name"] for f in requests.get(f"{running.url}/system/functions", auth=running.auth, timeout=5).json()]
        assert names == ["good"]
    finally:
        running.close()
    assert (store.folder / "badlabel.json.bad").exists() and (store.folder / "torn.json.bad").exists()
    assert json.loads((store.folder / "good.json").read_text())["desired"] == 1
