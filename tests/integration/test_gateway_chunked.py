"""Bodies read whole whatever their chunking: every /system/* handler and the built-in quart/echo."""

from __future__ import annotations

import os
import subprocess
import sys

import requests
from support.chunked_http import chunked_json, chunked_request
from support.faas_cli import Running, faas_cli_deploy_body


def test_system_bodies_sent_in_chunks_are_read_whole(gw):
    body = faas_cli_deploy_body("chunky", envVars={"pad": "x" * 20_000})  # bigger than one socket read
    status, out = chunked_json(gw.url, "POST", "/system/functions", body, pieces=7, auth=gw.auth)
    assert status == 202, out
    status, out = chunked_json(gw.url, "PUT", "/system/functions", body, pieces=5, auth=gw.auth)
    assert status == 200, out
    gw.wait_available("chunky", 1)
    status, out = chunked_json(gw.url, "POST", "/system/scale-function/chunky",
                               {"serviceName": "chunky", "replicas": 2}, pieces=3, auth=gw.auth)
    assert status == 202, out
    payload = os.urandom(50_000)
    status, out = chunked_request(gw.url, "POST", "/function/chunky", payload, pieces=6)
    assert status == 200 and out == payload
    status, out = chunked_json(gw.url, "DELETE", "/system/functions", {"functionName": "chunky"}, pieces=4,
                               auth=gw.auth)
    assert status == 200, out
    assert gw.describe("chunky").status_code == 404


def test_a_chunked_body_over_the_limit_is_413(tmp_path):
    running = Running(tmp_path, max_deploy_bytes=1024)
    try:
        status, out = chunked_json(running.url, "POST", "/system/functions",
                                   faas_cli_deploy_body("big", envVars={"pad": "x" * 4096}), auth=running.auth)
        assert status == 413 and b"limit" in out
    finally:
        running.close()


def test_echo_answers_chunked_bodies():
    proc = subprocess.Popen([sys.executable, "-m", "quart_provider.echo", "--port", "0"], stdout=subprocess.PIPE,
                            text=True)
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        payload = os.urandom(100_000)
        assert chunked_request(url, "POST", "/", payload, pieces=9, pause_s=0.01) == (200, payload)
        assert chunked_request(url, "POST", "/", b"", pieces=1) == (200, b"")
        assert requests.post(url, data=b"plain", timeout=5).content == b"plain"  # Content-Length still works
        with requests.Session() as keep_alive:  # chunked bodies back to back on one connection
            for i in range(3):
                res = keep_alive.post(url, data=iter([b"a" * i, b"b", b"c" * 70_000]), timeout=5)
                assert res.status_code == 200 and res.content == b"a" * i + b"b" + b"c" * 70_000
    finally:
        proc.terminate()
        proc.wait(10)
