"""quartctl as a user runs it (a subprocess), and waiting for `quartctl down` to leave nothing behind."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil


def quartctl(*args: str, cwd, timeout: float = 120, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quart_tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, input=stdin)



def descendants_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive



def down_and_wait(state, cwd, tracked: list[int], timeout_s: float = 15) -> None:
    """`quartctl down`, then wait until none of the processes `up` started is alive."""
    down = quartctl("down", "--state-dir", str(state), cwd=cwd)
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + timeout_s
    while descendants_alive(tracked):
        assert time.monotonic() < deadline, f"left running: {descendants_alive(tracked)}"
        time.sleep(0.1)

