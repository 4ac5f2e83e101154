"""Starting the KeysManager's children (``python -m keysmanager.zygote``) and the lifeline they watch.

Every child gets the KeysManager's pid (it dies with it), the read end of the lifeline pipe (a replica
exits when it reads EOF, i.e. when the KeysManager is gone) and the drain timeout.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from quart_stage.envpolicy import replica_base_env

from keysmanager.config import KeysManagerConfig


class Launcher:
    """``open()`` makes the lifeline pipe (we hold the only write end); ``popen`` starts a child."""

    def __init__(self, config: KeysManagerConfig) -> None:
        self.python = config.python or sys.executable
        self.drain_timeout_s = config.drain_timeout_s
        self.lifeline_r, self.lifeline_w = -1, -1

    def open(self) -> None:
        self.lifeline_r, self.lifeline_w = os.pipe()  # both O_CLOEXEC; the read end is passed explicitly

    def close(self) -> None:
        for fd in (self.lifeline_r, self.lifeline_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    @staticmethod
    def child_env() -> dict[str, str]:
        # OpenBLAS (numpy) starts a thread pool when loaded unless told not to: a zygote must have none
        # and never the daemon's credentials (registry keys, tokens): quart_stage.envpolicy
        return {**replica_base_env(os.environ), "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def popen(self, args: list[str], env: dict[str, str], log_path: Path, fds: tuple[int, ...]) -> subprocess.Popen:
        """``keysmanager.zygote`` with ``args``, its output appended to ``log_path``, ``fds`` inherited."""
        cmd = [self.python, "-m", "keysmanager.zygote", *args, "--parent-pid", str(os.getpid()),
               "--lifeline-fd", str(self.lifeline_r), "--drain-timeout", str(self.drain_timeout_s)]
        with open(log_path, "ab") as log:
            return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    pass_fds=(*fds, self.lifeline_r))
