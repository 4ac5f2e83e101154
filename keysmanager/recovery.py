"""The state dir across restarts: the pidfile that keeps one KeysManager per state dir, ``state.json`` (every
process it started, rewritten on change) and the clean-up a new KeysManager does from what the last one left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from keysmanager import sysutil
from keysmanager.config import KeysManagerConfig
from keysmanager.records import Replica, Zygote


def claim_state_dir(state_dir: Path) -> None:
    """Create the state dir (mode 0700) and write our pidfile; refuse while another KeysManager holds it."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(state_dir, 0o700)
    pidfile = state_dir / "km.pid"
    try:
        old = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        old = 0
    if old and old != os.getpid() and sysutil.is_running(old):
        try:
            cmd = " ".join(psutil.Process(old).cmdline())
        except psutil.Error:
            cmd = ""
        if "keysmanager" in cmd or "quartctl" in cmd or "pytest" in cmd:
            raise RuntimeError(f"another KeysManager (pid {old}) uses the state dir {state_dir}")
    pidfile.write_text(f"{os.getpid()} {sysutil.create_time(os.getpid())}\n")


def release_state_dir(state_dir: Path) -> None:
    (state_dir / "km.pid").unlink(missing_ok=True)


class StateFile:
    """``state.json``: what a restart must find. ``touch()`` on every change; ``write`` only rewrites then."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "state.json"
        self.dirty = True

    def touch(self) -> None:
        self.dirty = True

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def write(self, name: str, zygotes: Iterable[Zygote], replicas: Iterable[Replica]) -> None:
        if not self.dirty:
            return
        state = {
            "name": name,
            "pid": os.getpid(),
            "zygotes": [{"function": z.function, "pid": z.pid, "create_time": sysutil.create_time(z.pid),
                         "shm_path": str(z.segment.path)} for z in zygotes],
            "replicas": [{"id": r.id, "function": r.function, "pid": r.pid, "port": r.port, "source": r.source,
                          "mode": r.mode, "survive": r.survive, "gpu_slot": r.gpu_slot, "ready_ms": r.ready_ms,
                          "create_time": r.create_time or sysutil.create_time(r.pid)} for r in replicas],
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.path)
        self.dirty = False

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass
class Recovered:
    """What a new KeysManager found: pids it killed and adopted, segments it removed, the adopted replicas."""

    killed: list[int] = field(default_factory=list)
    adopted: list[int] = field(default_factory=list)
    removed_shm: list[str] = field(default_factory=list)
    replicas: list[Replica] = field(default_factory=list)

    def summary(self) -> dict[str, list]:
        return {"killed": self.killed, "adopted": self.adopted, "removed_shm": self.removed_shm}


def clean_leftovers(config: KeysManagerConfig) -> Recovered:
    """What a KeysManager that is gone left in its state folder, removed without starting a successor
    (`quartctl down` after a kill -9): every zygote and replica killed (survivors too), its shared-memory
    segments, socket, pidfile and state file removed."""
    state = StateFile(config.state_path).read()
    for r in state.get("replicas", []):
        r["survive"] = False
    found = recover(state, config)
    for path in (config.socket_path, config.state_path / "km.pid", config.state_path / "state.json"):
        path.unlink(missing_ok=True)
    return found


def recover(state: dict[str, Any], config: KeysManagerConfig) -> Recovered:
    """Clean up what a previous KeysManager with this state left: kill its zygotes and replicas (adopt the
    replicas told to survive), remove its shared-memory segments."""
    found = Recovered()
    for z in state.get("zygotes", []):
        if sysutil.is_running(z["pid"], z.get("create_time")):
            with contextlib.suppress(OSError):
                os.kill(z["pid"], signal.SIGKILL)
            found.killed.append(z["pid"])
    for r in state.get("replicas", []):
        if not sysutil.is_running(r["pid"], r.get("create_time")):
            continue
        if r.get("survive"):
            found.replicas.append(Replica(
                id=r["id"], function=r["function"], pid=r["pid"], port=r["port"], source=r["source"],
                mode=r.get("mode", "cow"), survive=True, requested_at=time.monotonic(), gpu_slot=r.get("gpu_slot"),
                cores=[], create_time=r.get("create_time", 0.0), state="ready", adopted=True,
                ready_ms=r.get("ready_ms")))
            found.adopted.append(r["pid"])
        else:
            with contextlib.suppress(OSError):
                os.kill(r["pid"], signal.SIGKILL)
            found.killed.append(r["pid"])
    for path in Path(config.shm_dir).glob(config.shm_prefix + "*"):
        path.unlink(missing_ok=True)
        found.removed_shm.append(str(path))
    return found
