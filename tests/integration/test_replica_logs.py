"""Replicas' access and error lines reach their function's log: ``GET /system/logs`` (what ``faas-cli logs`` and
``quartctl logs`` read) shows the access line of a call, with its call id, status, duration and bytes; an
uncaught exception in a stage app is logged with its traceback; ``QUART_LOG_FORMAT=json`` gives JSON lines."""

from __future__ import annotations

import json
import re
import time

import pytest
import requests
from flask import Flask
from quart_stage.logs import AccessLog, LogSettings, log_settings
from quart_stage.settings import ConfigError
from support.embedded_system import ThreadedSystem
from werkzeug.test import Client

ACCESS = re.compile(r"INFO access call_id=(\S+) method=POST path=/ status=200 duration_ms=[\d.]+ "
                    r"bytes_in=(\d+) bytes_out=(\d+) pid=\d+$")


def test_get_system_logs_returns_a_replicas_access_lines_after_a_call(tmp_path):
    system = ThreadedSystem(tmp_path)
    try:
        body = {"service": "talker", "image": "quart/echo:latest"}
        assert requests.post(f"{system.url}/system/functions", json=body, auth=system.auth,
                             timeout=30).status_code == 202
        res = requests.post(f"{system.url}/function/talker", data=b"hello logs", timeout=30)
        assert res.status_code == 200, res.text
        call_id = res.headers["X-Call-Id"]
        deadline = time.monotonic() + 10
        while True:
            logs = requests.get(f"{system.url}/system/logs", params={"name": "talker", "follow": "false"},
                                auth=system.auth, timeout=10)
            assert logs.status_code == 200
            texts = [json.loads(line)["text"] for line in logs.text.splitlines()]
            access = [m for t in texts if (m := ACCESS.search(t))]
            if access or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [(m.group(1), m.group(2), m.group(3)) for m in access] == [(call_id, "10", "10")], texts
    finally:
        system.close()


def test_access_log_middleware_logs_errors_with_their_traceback_and_json_on_request():
    app = Flask("t")

    @app.post("/")
    def ok():
        return b"answer"

    @app.get("/_/health")
    def health():
        return b"OK"

    @app.post("/boom")
    def boom():
        raise RuntimeError("the stage broke")

    app.config["PROPAGATE_EXCEPTIONS"] = True  # the exception reaches the middleware, as a WSGI server sees it
    lines: list[str] = []
    client = Client(AccessLog(app.wsgi_app, lines.append, LogSettings()))
    assert client.post("/", data=b"12345", headers={"X-Call-Id": "c1"}).data == b"answer"
    with pytest.raises(RuntimeError):
        client.post("/boom", data=b"x", headers={"X-Quart-Request-Id": "c2"})
    assert re.search(r"INFO access call_id=c1 method=POST path=/ status=200 duration_ms=[\d.]+ bytes_in=5 "
                     r"bytes_out=6 ", lines[0]), lines
    assert "ERROR access call_id=c2 method=POST path=/boom status=500" in lines[1]
    assert "Traceback (most recent call last)" in lines[1] and "RuntimeError: the stage broke" in lines[1]
    as_json: list[str] = []
    client = Client(AccessLog(app.wsgi_app, as_json.append, LogSettings(format="json")))
    assert client.get("/_/health").data == b"OK"  # health probes pass through, not logged
    assert client.post("/", data=b"1", headers={"X-Call-Id": "c3"}).data == b"answer"
    [doc] = [json.loads(line) for line in as_json]
    assert (doc["level"], doc["event"], doc["call_id"], doc["status"], doc["bytes_out"]) == ("info", "access", "c3",
                                                                                           200, 6)


def test_log_settings_refuse_unknown_levels_and_formats():
    assert log_settings({"QUART_LOG_LEVEL": "debug", "QUART_LOG_FORMAT": "json"}) == LogSettings("debug", "json")
    with pytest.raises(ConfigError, match="QUART_LOG_FORMAT"):
        log_settings({"QUART_LOG_FORMAT": "xml"})
    with pytest.raises(ConfigError, match="QUART_LOG_LEVEL"):
        log_settings({"QUART_LOG_LEVEL": "loud"})
