"""Run stage apps under gunicorn on an ephemeral loopback port (tests, demos, benchmarks).

`GunicornServer(env, app=...)` binds a socket to 127.0.0.1:0 in this process, passes it to gunicorn
(``--bind fd://N``) so the port is known before gunicorn starts, waits for ``/_/health``, and stops the
whole process group on exit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

MOUNTS_APP = "quart_stage.app:create_mounts_app_from_env()"
STAGE_APP = "quart_stage.app:create_app_from_env()"


class GunicornServer:
    """A gunicorn process serving `app` with `env`; use as a context manager. `url` is its base URL."""

    def __init__(self, env: Mapping[str, str], app: str = STAGE_APP, cwd: str | None = None,
                 workers: int = 1, extra_args: list[str] | None = None, startup_timeout: float = 120.0):
        self.env, self.app, self.cwd = dict(env), app, cwd
        self.workers, self.extra_args, self.startup_timeout = workers, list(extra_args or []), startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log = None
        self.sock: socket.socket | None = None
        self.url = ""

    def __enter__(self) -> GunicornServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        fd = self.sock.fileno()
        cmd = [sys.executable, "-m", "gunicorn", "--bind", f"fd://{fd}", "--workers", str(self.workers),
               "--timeout", "120", "--graceful-timeout", "5", "--limit-request-field_size", str(1 << 18),
               *self.extra_args, self.app]
        env = {**os.environ, **self.env}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, cwd=self.cwd, pass_fds=(fd,), start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        self._wait_ready()

    def _wait_ready(self) -> None:
        import requests

        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.logs()[-4000:]
                self.stop()
                raise RuntimeError(f"gunicorn exited with {self.proc.returncode} before it was ready:\n{err}")
            try:
                if requests.get(self.url + "/_/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"gunicorn did not answer {self.url}/_/health within {self.startup_timeout:.0f} s")

    def logs(self) -> str:
        """What gunicorn wrote to stderr so far."""
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)  # gunicorn: quick shutdown (SIGTERM waits for workers)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        if self.log is not None:
            self.log.close()
            self.log = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
