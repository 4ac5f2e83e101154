"""The README's walkthrough, top to bottom (slow tier): every command of its "Using it" and "Real pretrained
models" blocks runs, in a fresh folder, on a free port instead of 8080, with `set -euo pipefail`; `curl`
answers are checked too (`--fail`). faas-cli lines run only where faas-cli is installed."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

ROOT = REPO


def bash_blocks(section: str) -> list[str]:
    """The ```bash blocks of a README section (its text up to the next ## heading)."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", body, re.S)


def script(blocks: list[str], port: int) -> str:
    lines = []
    for block in blocks:
        block = block.replace("\\\n", " ")  # continued lines as one
        for line in block.splitlines():
            line = line.split("  # ")[0].rstrip()  # the README's comments
            if not line or line.startswith("source .venv"):
                continue
            if line.startswith("faas-cli") and shutil.which("faas-cli") is None:
                continue
            line = line.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
            line = re.sub(r"^curl -s(i?) ", r"curl --fail -s\1 ", line)
            if line.startswith("quartctl up "):
                line += f" --port {port}"
            lines.append(line)
    return "set -euxo pipefail\n" + "\n".join(lines) + "\n"  # -x: each command on stderr before it runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_readme_walkthrough_runs_top_to_bottom(tmp_path):
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for section in ("Using it", "Real pretrained models"):
        text = script(bash_blocks(section), port)
        assert "quartctl" in text
        res = subprocess.run(["bash", "-c", text], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=900)
        try:
            assert res.returncode == 0, f"{section}: exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
        finally:
            subprocess.run([sys.executable, "-m", "quart_tools.cli", "down"], cwd=tmp_path, env=env,
                           capture_output=True, timeout=120)
        if section == "Using it":
            assert "Ready: 4 function(s) serving" in res.stdout, res.stdout[-3000:]
            assert "INFO access" in res.stdout and "Removed pipeline small" in res.stdout
