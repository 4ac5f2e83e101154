"""The pipeline-stage OpenFaaS template: conventions of OpenFaaS's templates, and a shrinkwrapped build
(what `faas-cli build --shrinkwrap` lays out) served end to end by gunicorn."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys

import pytest
import requests
import torch
import yaml
from quart_stage import wire
from quart_stage.config import ConfigError
from quart_stage.serve import GunicornServer
from quart_tools.partition import partition
from support.paths import REPO

ROOT = str(REPO)
TEMPLATE = os.path.join(ROOT, "template", "pipeline-stage")
FUNCTIONS = os.path.join(ROOT, "functions")


def _dockerfile() -> str:
    with open(os.path.join(TEMPLATE, "Dockerfile"), encoding="utf-8") as f:
        return f.read()


def test_template_yml_follows_faas_cli_conventions():
    doc = yaml.safe_load(open(os.path.join(TEMPLATE, "template.yml")))
    assert doc["language"] == os.path.basename(TEMPLATE)  # faas-cli finds templates by folder == language
    assert doc["fprocess"] == "gunicorn index:app"
    assert doc["welcome_message"].strip()
    for option in doc["build_options"]:
        assert set(option) == {"name", "packages"} and option["packages"]
    for path in ("Dockerfile", "index.py", "requirements.txt", "function/handler.py", "function/requirements.txt"):
        assert os.path.isfile(os.path.join(TEMPLATE, path)), path


def test_dockerfile_runs_of_watchdog_http_mode_as_non_root_with_healthcheck():
    text = _dockerfile()
    assert re.search(r"^FROM .*of-watchdog:\S+ AS watchdog$", text, re.M)
    assert "COPY --from=watchdog /fwatchdog /usr/bin/fwatchdog" in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in {"root", "0"}
    assert re.search(r"^HEALTHCHECK .*/tmp/\.lock", text, re.M)
    fprocess = re.search(r'^ENV fprocess="([^"]+)"$', text, re.M).group(1)
    assert fprocess == yaml.safe_load(open(os.path.join(TEMPLATE, "template.yml")))["fprocess"]
    assert re.search(r'^ENV mode="http"$', text, re.M)
    upstream = re.search(r'^ENV upstream_url="http://127.0.0.1:(\d+)"$', text, re.M).group(1)
    conf = open(os.path.join(TEMPLATE, "gunicorn.conf.py")).read()
    assert f'"127.0.0.1:{upstream}"' in conf  # gunicorn listens where of-watchdog forwards
    assert text.rstrip().endswith('CMD ["fwatchdog"]')
    for copied in ("index.py", "gunicorn.conf.py", "requirements.txt", "quart_stage", "function/requirements.txt"):
        assert copied in text


def test_template_requirements_pin_what_the_project_pins():
    def pins(path):
        return {line.split("==")[0]: line.strip() for line in open(path) if "==" in line and not line.startswith("#")}

    ours, project = pins(os.path.join(TEMPLATE, "requirements.txt")), pins(os.path.join(ROOT, "requirements.txt"))
    assert ours["torch"] == "torch==2.13.0"
    for name, line in ours.items():
        assert project.get(name) == line, name


def _faas_cli_new(tmp_path, name: str) -> str:
    """What `faas-cli new NAME --lang pipeline-stage` does: copy the template's function/ to ./NAME/."""
    handler_dir = str(tmp_path / name)
    shutil.copytree(os.path.join(TEMPLATE, "function"), handler_dir)
    return handler_dir


def _shrinkwrap(tmp_path, name: str, handler_dir: str) -> str:
    """What `faas-cli build --shrinkwrap` does: template -> build/NAME/, handler -> build/NAME/function/."""
    build = str(tmp_path / "build" / name)
    shutil.copytree(TEMPLATE, build, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(os.path.join(build, "function"))
    shutil.copytree(handler_dir, os.path.join(build, "function"), ignore=shutil.ignore_patterns("__pycache__"))
    return build


def test_faas_cli_new_gives_a_handler_with_the_python3_http_contract(tmp_path):
    handler_dir = _faas_cli_new(tmp_path, "my-stage")
    source = open(os.path.join(handler_dir, "handler.py")).read()
    assert "handle = StageHandler.from_env()" in source
    assert os.path.isfile(os.path.join(handler_dir, "requirements.txt"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tpl") / "tiny")
    partition("tiny", 2, d, progress=False)
    return d


def test_shrinkwrapped_build_serves_a_stage_end_to_end(tmp_path, model_dir):
    build = _shrinkwrap(tmp_path, "tiny-stage-0", os.path.join(FUNCTIONS, "decoder-lm"))
    env = {"QUART_MODEL_DIR": model_dir, "QUART_STAGE_INDEX": "0", "QUART_NUM_STAGES": "2",
           "QUART_COMPUTE": "cpu", "QUART_MAX_BODY_BYTES": str(1 << 20),
           "PYTHONPATH": ""}  # quart_stage must come from the build folder, as in the image
    with GunicornServer(env, app="index:app", cwd=build, extra_args=["--config", "gunicorn.conf.py"]) as server:
        health = requests.get(server.url + "/_/health", timeout=10).json()
        assert health["stage"] == 0 and health["model"] == "tiny"
        r = requests.post(server.url, json={"input_ids": [[1, 2, 3]]}, headers={"X-Quart-Request-Id": "r1"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"] == wire.CONTENT_TYPE and r.headers["X-Quart-Request-Id"] == "r1"
        assert r.headers["X-Quart-Compute-Mode"] == "cpu" and float(r.headers["X-Quart-Compute-Ms"]) >= 0
        assert wire.decode(r.content).tensors["hidden_states"].shape == (1, 3, 64)
        big = requests.post(server.url, data=b"\0" * ((1 << 20) + 1),
                            headers={"Content-Type": wire.CONTENT_TYPE}, timeout=30)
        assert big.status_code == 413 and big.json()["field"] == "body"
        bad = requests.post(server.url, data=b"\1\2\3", headers={"Content-Type": wire.CONTENT_TYPE}, timeout=30)
        assert bad.status_code == 400 and bad.json()["field"] == "body"
        again = requests.post(server.url, data=wire.encode_bytes({"input_ids": torch.tensor([[4, 5]])}),
                              headers={"Content-Type": wire.CONTENT_TYPE}, timeout=30)
        assert again.status_code == 200
        pids = os.popen(f"pgrep -g {server.proc.pid}").read().split()
        assert pids, "gunicorn runs"
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert b"gunicorn" in f.read()
            cwd = os.readlink(f"/proc/{pid}/cwd")
            assert cwd == build


def _import_handler(path: str, env: dict, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spec = importlib.util.spec_from_file_location(f"handler_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_family_handlers_refuse_the_other_family(model_dir, monkeypatch):
    env = {"QUART_MODEL_DIR": model_dir, "QUART_STAGE_INDEX": "1"}
    module = _import_handler(os.path.join(FUNCTIONS, "decoder-lm", "handler.py"), env, monkeypatch)

    class Event:
        body = wire.encode_bytes({"hidden_states": torch.zeros(1, 2, 64)})
        headers = {"Content-Type": wire.CONTENT_TYPE}
        method = "POST"

    out = module.handle(Event(), None)
    assert out["statusCode"] == 200 and out["headers"]["X-Quart-Stage"] == "1"
    with pytest.raises(ConfigError, match="decoder model"):
        _import_handler(os.path.join(FUNCTIONS, "encoder", "handler.py"), env, monkeypatch)
    assert sys.modules.get("quart_stage") is not None
