"""The status page at /ui/: served by the gateway behind its basic auth, static files plus the JSON it polls;
loaded in headless Chromium (Debian's ``chromium``; skipped where it is absent) against a running gateway, the
page shows the pipeline's stages, replicas with host and start source, the controller's decisions and the
two charts."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest
import requests
from support.embedded_system import deploy_echo_pipeline, plugin_system

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    system = plugin_system(tmp_path, monkeypatch, "0.2")
    try:
        deploy_echo_pipeline(system, "m", 3)
        for _ in range(10):
            assert requests.post(f"{system.url}/function/m", data=b"x" * 100, timeout=30).status_code == 200
        time.sleep(0.6)  # control steps: decisions and snapshots
        yield system
    finally:
        system.close()


def test_ui_is_behind_basic_auth_and_its_json_carries_the_system(pipeline):
    url = pipeline.url
    assert requests.get(f"{url}/ui/", timeout=10).status_code == 401
    assert requests.get(f"{url}/ui/api/status", timeout=10).status_code == 401
    page = requests.get(f"{url}/ui/", auth=pipeline.auth, timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert '<script src="app.js">' in page.text
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        res = requests.get(f"{url}/ui/{name}", auth=pipeline.auth, timeout=10)
        assert res.status_code == 200 and kind in res.headers["Content-Type"]
    assert requests.get(f"{url}/ui/nope", auth=pipeline.auth, timeout=10).status_code == 404
    doc = requests.get(f"{url}/ui/api/status", auth=pipeline.auth, timeout=10).json()
    [p] = doc["pipelines"]
    assert p["model"] == "m" and [s["name"] for s in p["stages"]] == ["m-stage-0", "m-stage-1", "m-stage-2"]
    stage = p["stages"][0]
    assert stage["desired"] == stage["ready"] == 1 and stage["arrival_rate"] > 0
    assert [(r["host"], r["source"], r["state"]) for r in stage["replicas"]] == [("host-0", "cold", "ready")]
    assert p["latency"]["count"] == 10 and p["latency"]["p99_ms"] >= p["latency"]["p50_ms"] > 0
    assert p["decisions"] and p["decisions"][0]["desired"] == [1, 1, 1]
    assert p["history"]["replicas"] and sum(r["count"] for r in p["history"]["latency"]) == 10
    assert doc["hosts"] == [{"name": "host-0", "slots": 4, "used": 3}]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install -y chromium)")
def test_the_page_shows_the_data_in_headless_chromium(pipeline, tmp_path):
    user, password = pipeline.auth
    url = pipeline.url.replace("http://", f"http://{user}:{password}@") + "/ui/"
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=5000"]
    res = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert "policy quart · 1 pipeline(s) · 3 stage(s) · 1 host(s)" in dom, dom[:2000]
    for i in range(3):
        assert f"<td>m-stage-{i}</td>" in dom
    assert dom.count('<span class="src">cold</span> · ready') == 3
    assert "host-0 3/4 slots" in dom and "10 request(s)" in dom
    assert len(re.findall(r'<path d="M[^"]+" [^>]*class="series" data-name="stage \d"', dom)) == 3  # replicas chart
    assert 'data-name="p99"' in dom and "Last decisions of the controller" in dom and "no decision yet" not in dom
    shot = tmp_path / "ui.png"
    res = subprocess.run([*args, "--window-size=1280,900", f"--screenshot={shot}", url], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and shot.stat().st_size > 10_000, res.stderr[-2000:]
