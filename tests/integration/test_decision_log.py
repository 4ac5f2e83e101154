"""The controller logs every scaling decision and every placement it cannot make, and /system/functions carries
the last decision (``lastDecision``, annotation ``com.quart.last-decision``) beside the reason it is not ready."""

from __future__ import annotations

import logging
import time

import requests
from support.embedded_system import deploy_echo_pipeline, plugin_system


def test_decisions_and_unplaceable_replicas_are_logged_and_shown(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("QUART_POLICY", "static")  # 2 replicas per stage: 6 asked, 4 slots
    caplog.set_level(logging.INFO, logger="quart")
    system = plugin_system(tmp_path, monkeypatch, "0.1", gpus_per_host=4)
    try:
        deploy_echo_pipeline(system, "m", 3)
        deadline = time.monotonic() + 20
        while "cannot place" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text[-3000:]
            time.sleep(0.1)
        for i in range(3):
            assert f"scale m-stage-{i} 1 -> 2: " in caplog.text, caplog.text[-3000:]
        assert "replica slot" in next(r.getMessage() for r in caplog.records if "cannot place" in r.getMessage())
        deadline = time.monotonic() + 20
        while True:  # until the 4 slots are taken; the rest waits
            functions = {f["name"]: f for f in requests.get(f"{system.url}/system/functions", auth=system.auth,
                                                            timeout=10).json()}
            if sum(fn["availableReplicas"] for fn in functions.values()) == 4:
                break
            assert time.monotonic() < deadline, functions
            time.sleep(0.1)
        for fn in functions.values():
            assert " 1 -> 2: " in fn["lastDecision"], fn
            assert fn["annotations"]["com.quart.last-decision"] == fn["lastDecision"]
        waiting = [fn for fn in functions.values() if fn["availableReplicas"] < 2]
        assert waiting and all("replica slot" in fn["reason"] for fn in waiting), functions
    finally:
        system.close()
