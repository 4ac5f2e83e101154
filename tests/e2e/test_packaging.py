"""`pip install .` gives a working quartctl: pyproject.toml declares the runtime dependencies (requirements.txt's
runtime part, kept equal here) and the test tools as the `test` extra; every third-party module the code
imports comes from a declared dependency (or one of theirs); and, in the slow tier, a fresh venv gets a
working ``quartctl --version`` from ``pip install .`` offline."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from support.paths import REPO

ROOT = REPO
PACKAGE_DIRS = {name: ROOT / folder for name, folder in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}
PACKAGES = tuple(PACKAGE_DIRS)  # the project's own top-level packages (quart_stage … quart_tools)


def _name(requirement: str) -> str:
    return re.split(r"[\[=<>!~; ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements() -> tuple[list[str], list[str]]:
    runtime, test, part = [], [], "runtime"
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith("# tests and lint"):
            part = "test"
        elif line and not line.startswith("#"):
            (runtime if part == "runtime" else test).append(line.strip())
    return runtime, test


def test_pyproject_declares_the_runtime_pins_and_a_test_extra():
    project = _pyproject()["project"]
    runtime, test = _requirements()
    assert project["dependencies"] == runtime
    assert project["optional-dependencies"]["test"] == test
    assert not {_name(r) for r in runtime} & {"pytest", "ruff", "hypothesis", "moto", "schemathesis"}


def _closure(names: set[str]) -> set[str]:
    """The distributions ``names`` need, transitively (installed ones; extras' requirements left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def _third_party_imports() -> set[str]:
    """Top-level modules imported anywhere in the product and the tools, not of this project nor the stdlib."""
    found: set[str] = set()
    for folder in PACKAGE_DIRS.values():
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in PACKAGES and m != "function"}


def test_every_third_party_import_comes_from_a_declared_dependency():
    declared = _closure({_name(r) for r in _pyproject()["project"]["dependencies"]})
    providers = metadata.packages_distributions()
    missing = {}
    for module in sorted(_third_party_imports()):
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        if not dists & declared:
            missing[module] = sorted(dists) or ["(not installed)"]
    # optional extras, imported lazily where used and documented (docs/dependencies.md)
    for optional in ("pynvml", "cupy", "kubernetes", "moto", "hypothesis", "pytest"):
        missing.pop(optional, None)
    assert not missing, f"imported but not declared in pyproject.toml dependencies: {missing}"


@pytest.mark.slow
def test_pip_install_in_a_fresh_venv_gives_a_working_quartctl(tmp_path):
    """Offline: the fresh venv sees this environment's installed packages through a .pth (as
    --system-site-packages would), so pip resolves every declared pin without an index (a pin that differs from
    what is installed fails), builds the project without build isolation, and installs it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = Path(subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    res = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--no-index", "--no-build-isolation",
                          "--no-cache-dir", str(ROOT)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = subprocess.run([str(venv / "bin/quartctl"), "--version"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "quartctl 0.1.0", res.stdout + res.stderr
    res = subprocess.run([str(venv / "bin/quartctl"), "list", "--gateway", "http://127.0.0.1:9"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 1 and "cannot reach the gateway" in res.stderr, res.stderr
    # the installed copy, not this tree, answered; the status page's files are in the wheel
    res = subprocess.run([str(venv / "bin/python"), "-c", "import quart_tools, gateway_plugin.webui as w; "
                          "print(quart_tools.__file__); print(len(w.static_file('app.js')))"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0 and str(venv) in res.stdout.splitlines()[0], res.stdout + res.stderr
