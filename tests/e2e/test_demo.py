"""Smoke test of `quartctl demo` (the README's main job) on the tiny preset."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest


def _leftovers(marker: str) -> list[psutil.Process]:
    """Processes whose command line names this test's own state folder (so only ones it started)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline and proc.info["pid"] != os.getpid():
            found.append(proc)
    return found


def _demo(argv: list[str], env: dict[str, str], state, cwd) -> tuple[str, list[psutil.Process]]:
    """Run the demo; (its stdout, the processes it left behind, killed by then). Fails unless it exits 0."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=cwd, env=env)
    finally:
        leftovers = _leftovers(str(state))
        for proc in leftovers:  # never leave processes behind, even when the assertion below fails
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, leftovers


@pytest.mark.parametrize("policy", ["quart", "infless"])  # infless undoes the manual scale at once: the pin path
def test_demo_runs_end_to_end_on_tiny_and_leaves_nothing_running(tmp_path, policy):
    state = tmp_path / "demo-state"
    argv = [sys.executable, "-m", "quart_tools.cli", "demo", "--model", "tiny", "--stages", "2", "--hosts", "1",
            "--requests", "1", "--state-dir", str(state)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUART_")}
    env["QUART_POLICY"] = policy  # the autoscaler acts (actuator gateway): the demo must not hang on it
    out, leftovers = _demo(argv, env, state, tmp_path)
    for step in ("[1/6]", "[2/6]", "[3/6]", "[4/6]", "[5/6]", "[6/6]"):
        assert step in out
    assert "-> 200" in out and "next-token id(s)" in out
    assert "-> 202 Accepted" in out and "X-Function-Status 200" in out  # the async batch call and its callback
    assert "'replicas': 2" in out and "second replica ready" in out
    assert "tiny-stage-1" in out and "started by fork" in out
    assert f"the autoscaler (policy {policy}" in out
    # whether the policy undoes the manual count at once (infless usually does) or would after its cool-down
    # (quart: it did while a loaded machine slowed the demo's last steps), the demo pins the floor
    assert "it set tiny-stage-1 back to" in out or "it keeps 2 replica(s) so far" in out
    assert "com.openfaas.scale.min=2" in out and "tiny-stage-1: 2 replicas available after" in out
    listing = out.split("GET /system/functions:")[1]
    assert any(line.split()[:3] == ["tiny-stage-1", "2", "2"] for line in listing.splitlines())
    assert leftovers == []


def test_demo_default_model_gives_a_real_answer_and_forks_the_scaled_stage(tmp_path):
    """`make demo`'s model: the pretrained MiniLM's cosine similarities come back through the gateway, and
    the scaled stage's second replica forks where the stage is cached (source and time printed)."""
    state = tmp_path / "demo-state"
    argv = [sys.executable, "-m", "quart_tools.cli", "demo", "--stages", "2", "--hosts", "1", "--requests", "1",
            "--state-dir", str(state)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUART_")}
    out, leftovers = _demo(argv, env, state, tmp_path)
    assert "+0.667  'A man is playing a guitar.' vs 'Someone plays an instrument.'" in out
    assert "-0.054  'A man is playing a guitar.' vs 'The stock market fell sharply today.'" in out
    assert "second replica ready in" in out and "(placer cache-aware)" in out
    forked = [line for line in out.splitlines() if line.strip().startswith("minilm-stage-1-") and "started by fork" in line]
    assert forked and " ms served" in forked[0]
    assert leftovers == []
