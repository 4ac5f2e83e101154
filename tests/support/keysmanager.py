"""KeysManager daemons under test: real processes on private Unix sockets, emulated and real stage specs."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from keysmanager.client import KeysManagerClient, KeysManagerError
from keysmanager.config import KeysManagerConfig
from keysmanager.types import StageSpec

EMULATED = {"QUART_PROFILE": "bert-21b", "QUART_NUM_STAGES": "8", "QUART_STAGE_INDEX": "0",
            "QUART_COMPUTE": "emulated", "QUART_EMULATED_MEAN_MS": "2", "QUART_EMULATED_CV": "0"}



IDS = {"input_ids": [[1, 2, 3, 4]]}



def emulated(function: str = "emu-stage-0", **env: str) -> StageSpec:
    return StageSpec(function, env={**EMULATED, **env})



class Daemon:
    """One KeysManager process under test."""

    def __init__(self, root: Path, name: str, *extra: str) -> None:
        self.root, self.name = root, name
        self.socket = root / f"{name}.sock"
        self.state_dir = root / f"{name}-state"
        self.args = ["--name", name, "--socket", str(self.socket), "--state-dir", str(self.state_dir), *extra]
        self.proc: subprocess.Popen | None = None
        self.client = KeysManagerClient(str(self.socket), timeout=120)

    @property
    def shm_prefix(self) -> str:
        return KeysManagerConfig(name=self.name, state_dir=str(self.state_dir)).shm_prefix

    def shm_files(self) -> list[Path]:
        return sorted(Path("/dev/shm").glob(self.shm_prefix + "*"))

    def start(self) -> Daemon:
        log = open(self.root / f"{self.name}.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen([sys.executable, "-m", "keysmanager.daemon", *self.args], stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.health()
                return self
            except KeysManagerError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"daemon did not start: {(self.root / f'{self.name}.log').read_text()}") from None
                time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)



@contextlib.contextmanager
def daemons_in_temp_dir():
    """(root, daemons, extra pids): kills every daemon and pid at exit and removes their segments."""
    root = Path(tempfile.mkdtemp(prefix="km-", dir="/tmp"))  # short: Unix socket paths are limited to 107 bytes
    daemons: list[Daemon] = []
    pids: list[int] = []
    try:
        yield root, daemons, pids
    finally:
        for d in daemons:
            d.kill(signal.SIGTERM)
        for pid in pids:  # anything a test started that may have outlived its daemon (survivors)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for d in daemons:
            for f in d.shm_files():
                f.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)



@contextlib.contextmanager
def preloaded_daemon(name: str) -> Iterator[Daemon]:
    """One KeysManager daemon in a temporary folder with the emulated preloader up (a start forks at once)."""
    with daemons_in_temp_dir() as (root, daemons, _pids):
        d = Daemon(root, name).start()
        daemons.append(d)
        d.client.ensure_cached(emulated())
        yield d


@contextlib.contextmanager
def tiny_model_daemon(name: str) -> Iterator[tuple[Path, Path, Daemon]]:
    """(temp root, the tiny model partitioned into 2 stages there, a started daemon); at exit the daemon is asked
    to shut down, must stop within 30 s and must have removed its shared-memory segments."""
    from quart_tools.partition import partition

    with daemons_in_temp_dir() as (root, daemons, _):
        model = root / "tiny"
        partition("tiny", 2, str(model), progress=False)
        d = Daemon(root, name)
        daemons.append(d)
        yield root, model, d.start()
        assert d.client.shutdown()["stopping"]
        d.proc.wait(30)
        assert not d.shm_files(), "the KeysManager removed its segments"


@pytest.fixture
def km_root():
    with daemons_in_temp_dir() as state:
        yield state



@pytest.fixture
def daemon(km_root):
    """Start a private daemon (for tests that kill it, restart it or need special limits)."""
    root, daemons, _ = km_root

    def make(name: str = "h0", *extra: str) -> Daemon:
        d = Daemon(root, name, *extra)
        daemons.append(d)
        return d.start()

    return make



def zygote_of(d: Daemon, function: str):
    return next((z for z in d.client.zygotes() if z.function == function), None)



def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")



def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie of someone else's (init reaps those)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True



def raw_post(path: str, body: bytes, socket_path: Path) -> tuple[int, dict]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(socket_path))
    conn = http.client.HTTPConnection("localhost")
    conn.sock = sock
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, data = resp.status, json.loads(resp.read())
    conn.close()
    return status, data



def stage(model_dir: Path, index: int, function: str | None = None, compute: str = "cpu") -> StageSpec:
    manifest = json.loads((model_dir / "manifest.json").read_text())
    return StageSpec(function or f"{manifest['model']}-stage-{index}",
                     env={"QUART_MODEL_DIR": str(model_dir), "QUART_STAGE_INDEX": str(index),
                          "QUART_COMPUTE": compute})



def infer(url: str, request_id: str = "same-id", ids=IDS) -> bytes:
    resp = requests.post(url, json=ids, headers={"X-Quart-Request-Id": request_id}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.content

