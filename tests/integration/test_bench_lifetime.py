"""A benchmark stopped by SIGTERM (``timeout``) or SIGINT leaves no process behind (quart_tools.bench.lifetime).

Before, a bench killed by ``timeout`` died at once: `quartctl up` (in a session of its own) and KeysManagers
kept running as orphans of init. Now every `quartctl bench` unwinds on the first signal (its ``finally``
blocks, ``asyncio.run``'s cancellation) and then stops any child still running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from support.cli import descendants_alive

BENCH_LIKE = textwrap.dedent("""
    import asyncio, subprocess, sys, time
    from pathlib import Path
    from quart_tools.bench.lifetime import run_bench

    marker = Path(sys.argv[1])

    class Gateway:  # as quart_tools.bench.policies.Gateway: its own session, waits in its constructor
        def __init__(self):
            self.proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
            print(self.proc.pid, flush=True)

    async def serve():
        helper = subprocess.Popen(["sleep", "300"])
        print(helper.pid, flush=True)
        try:
            print("ready", flush=True)
            await asyncio.sleep(300)
        finally:  # what a bench's asyncio code does to stop its EmbeddedSystem
            helper.terminate()
            helper.wait()
            marker.write_text("cleaned")

    def main(argv):
        Gateway()  # no try owns it: the signal comes before close() could be reached
        asyncio.run(serve())

    sys.exit(run_bench(main, [], grace_s=5))
""")


def _gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running (not zombies) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while descendants_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return descendants_alive(pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_unwinds_the_bench_and_stops_every_child(tmp_path, sig):
    marker = tmp_path / "cleaned"
    bench = subprocess.Popen([sys.executable, "-c", BENCH_LIKE, str(marker)], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout is not None
        gateway, helper = int(bench.stdout.readline()), int(bench.stdout.readline())
        assert bench.stdout.readline().strip() == "ready"
        bench.send_signal(sig)
        assert bench.wait(30) == 128 + sig
        assert marker.read_text() == "cleaned", "the bench's finally did not run"
        assert _gone([gateway, helper], 10) == [], "a child of the bench outlived it"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def test_sigterm_to_a_real_bench_leaves_no_keysmanager(tmp_path):
    """`quartctl bench keysmanager` starts a KeysManager daemon; `timeout` (SIGTERM) while it runs."""
    short = Path(tempfile.mkdtemp(prefix="qb-", dir="/tmp"))  # the daemon's socket path must stay short
    env = {**os.environ, "TMPDIR": str(short)}
    bench = subprocess.Popen([sys.executable, "-m", "quart_tools.cli", "bench", "keysmanager", "--sizes", "1",
                              "--reps", "50", "--pss-replicas", "0", "--isolated-replicas", "0",
                              "--out", str(tmp_path / "out.json")], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    family: list[int] = []
    try:
        me = psutil.Process(bench.pid)
        deadline = time.monotonic() + 120
        while not any("keysmanager.daemon" in _cmdline(p) for p in _descendants(me)):
            assert bench.poll() is None and time.monotonic() < deadline, "the bench never started its KeysManager"
            time.sleep(0.1)
        time.sleep(1.0)  # it works: starts replicas
        family += [p.pid for p in _descendants(me)]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        assert _gone(family, 15) == [], "processes of the bench outlived it"
        assert not list(short.glob("km-bench-*")), "its temp folder was not removed"
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        for pid in _gone(family, 0):  # a failed run must not leave them either
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(short, ignore_errors=True)


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # it ended between the listing and this look (the bench's short-lived children)
        return ""
