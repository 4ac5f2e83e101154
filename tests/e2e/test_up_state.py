"""`quartctl up` and `down` make their state explicit: `up -f` deploys exactly that stack (a previous run's other
functions are removed, and it says so), `up` alone says what it restored, `down --purge` forgets the functions;
`up` reports each function's readiness and which replicas cannot be placed, not a bare "Ready."."""

from __future__ import annotations

import json
import re

import requests
import yaml
from support.cli import down_and_wait, quartctl


def stack(path, **functions: int) -> None:
    path.write_text(yaml.safe_dump({
        "version": 1.0, "provider": {"name": "openfaas", "gateway": "http://127.0.0.1:8080"},
        "functions": {name: {"lang": "dockerfile", "handler": "./echo", "image": "quart/echo:latest",
                             "labels": {"com.openfaas.scale.min": str(n)}} for name, n in functions.items()}}))


def up(state, cwd, *args: str):
    res = quartctl("up", *args, "--port", "0", "--state-dir", str(state), "--process-hosts", "--gpus-per-host", "4",
                   "--wait", "30", "--detach", cwd=cwd, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    info = json.loads((state / "up.json").read_text())
    password = (state / "secrets" / "basic-auth-password").read_text().strip()
    names = sorted(f["name"] for f in requests.get(f"{info['url']}/system/functions", auth=("admin", password),
                                                     timeout=10).json())
    return res.stdout, names, [info["pid"]] + [h["pid"] for h in info["hosts"]]


def test_up_f_deploys_exactly_its_stack_reports_readiness_and_down_purge_forgets(tmp_path):
    state = tmp_path / "state"
    stack(tmp_path / "two.yml", big=3, squeezed=3)  # 6 replicas asked, 4 slots: squeezed cannot get all 3
    stack(tmp_path / "one.yml", other=1)
    tracked: list[int] = []
    try:
        out, names, tracked = up(state, tmp_path, "-f", "two.yml")
        assert names == ["big", "squeezed"]
        lines = [x for x in out.splitlines() if x.startswith("Function: ")]
        assert len(lines) == 2 and all("NOT READY" not in x or "free replica slot" in x for x in lines), out
        ready = [int(m) for m in re.findall(r"(\d)/3 replica\(s\)", out)]
        assert sum(ready) == 4 and min(ready) < 3, out  # the 4 slots full (shared as the placer shares them)
        assert re.search(r"Serving; [12] of 2 function\(s\) NOT READY", out) and "Ready:" not in out
        down_and_wait(state, tmp_path, tracked)

        out, names, tracked = up(state, tmp_path, "-f", "one.yml")
        assert names == ["other"], out
        assert "Removed 2 function(s) of the previous run" in out and "big, squeezed" in out
        assert "Function: other: ready, 1/1 replica(s)" in out and "Ready: 1 function(s) serving" in out
        down_and_wait(state, tmp_path, tracked)

        out, names, tracked = up(state, tmp_path)
        assert names == ["other"] and "Restored 1 function(s) of the previous run" in out, out
        down = quartctl("down", "--purge", "--state-dir", str(state), cwd=tmp_path)
        assert down.returncode == 0 and "Forgot 1 deployed function(s): other" in down.stdout, down.stdout
        tracked_now, tracked = tracked, []
        down_and_wait(state, tmp_path, tracked_now)

        out, names, tracked = up(state, tmp_path)
        assert names == [] and "Restored" not in out and "Ready: 0 function(s) serving" in out, out
    finally:
        down_and_wait(state, tmp_path, tracked)
