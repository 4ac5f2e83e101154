"""`quartctl up --detach`, `quartctl deploy`, `quartctl down`: real processes, nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import requests
from support.cli import down_and_wait, quartctl


def test_up_detached_deploy_down(tmp_path):
    (tmp_path / "stack.yml").write_text(textwrap.dedent("""
        version: 1.0
        provider: {name: openfaas, gateway: http://127.0.0.1:8080}
        functions:
          echo:
            lang: dockerfile
            handler: ./echo
            image: quart/echo:latest
            labels: {com.openfaas.scale.min: 2}
    """))
    state = tmp_path / "state"
    res = quartctl("up", "-f", "stack.yml", "--port", "0", "--state-dir", str(state), "--detach", cwd=tmp_path)
    tracked: list[int] = []
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        assert "Gateway:" in res.stdout and "basic-auth-password" in res.stdout
        info = json.loads((state / "up.json").read_text())
        tracked = [info["pid"]] + [h["pid"] for h in info["hosts"]]
        url, password = info["url"], (state / "secrets" / "basic-auth-password").read_text().strip()
        assert (state / "secrets" / "basic-auth-password").stat().st_mode & 0o777 == 0o600
        again = quartctl("up", "--port", "0", "--state-dir", str(state), cwd=tmp_path)
        assert again.returncode == 1 and "already running" in again.stderr

        deadline = time.monotonic() + 60
        while True:
            status = requests.get(f"{url}/system/function/echo", auth=("admin", password), timeout=5).json()
            if status["availableReplicas"] == 2:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        tracked += [psutil.Process(info["pid"]).pid]
        tracked += [c.pid for c in psutil.Process(info["pid"]).children(recursive=True)]
        assert requests.post(f"{url}/function/echo", data=b"hi", timeout=5).content == b"hi"

        res = quartctl("deploy", "-f", "stack.yml", "--state-dir", str(state), cwd=tmp_path)  # faas-cli's PUT
        assert res.returncode == 0 and "already exists, attempting rolling-update" in res.stdout, res.stdout
        res = quartctl("deploy", "-f", "stack.yml", "--state-dir", str(state), "--password-stdin", cwd=tmp_path)
        assert res.returncode == 1 and "unauthorized" in res.stderr  # empty password from stdin
    finally:
        down_and_wait(state, tmp_path, tracked)
    assert not (state / "up.json").exists()
    assert "nothing is running" in quartctl("down", "--state-dir", str(state), cwd=tmp_path).stdout


def test_down_stops_a_gateway_that_is_not_a_process_group_leader(tmp_path):
    """Started under `timeout` or from a shell job, the gateway's pid leads no process group: killpg fails
    with "no such process"; `down` must still stop it (signal the pid), wait, and only then say so."""
    state = tmp_path / "state"
    state.mkdir()
    gateway = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # our process group
    try:
        assert os.getpgid(gateway.pid) != gateway.pid
        (state / "up.json").write_text(json.dumps({"pid": gateway.pid, "url": "http://127.0.0.1:1", "hosts": []}))
        down = quartctl("down", "--state-dir", str(state), cwd=tmp_path, timeout=60)
        assert down.returncode == 0, down.stderr
        assert f"Stopped the gateway (pid {gateway.pid})" in down.stdout
        assert gateway.wait(timeout=10) is not None  # really gone (reaped here: it is our child)
        assert not (state / "up.json").exists()
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


def test_stop_process_signals_the_pid_and_reports_whether_it_is_gone(tmp_path):
    from quart_provider.system import stop_process

    stubborn = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('ready', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout.readline().strip() == "ready"
        started = time.monotonic()
        assert stop_process(stubborn.pid, grace_s=0.5) is True  # SIGTERM ignored → SIGKILL after the grace
        assert time.monotonic() - started < 10
        assert stubborn.wait(timeout=5) == -9
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
            stubborn.wait()
    assert stop_process(stubborn.pid) is True  # already gone
