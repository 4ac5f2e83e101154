"""The system `quartctl bench chaos` works on: one `quartctl up` process on a state folder (:class:`Gateway`),
when its functions serve, the pids of its replicas."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
from quart_provider.system import stop_process


class Gateway:
    """One `quartctl up` process on a state folder; ``start`` again after ``stop`` restores its functions."""

    def __init__(self, state_dir: Path, args: list[str]) -> None:
        self.state_dir, self.args = state_dir, args
        self.process: subprocess.Popen | None = None
        self.url, self.auth = "", aiohttp.BasicAuth("admin", "")
        self.phases: dict[str, float] = {}  # of the last restart

    def start(self, timeout_s: float = 120.0, extra: tuple[str, ...] = ()) -> None:
        log = open(self.state_dir.parent / "gateway.log", "ab")  # noqa: SIM115 - the child's
        state_file = self.state_dir / "up.json"
        state_file.unlink(missing_ok=True)
        self.process = subprocess.Popen([sys.executable, "-m", "quart_tools.cli", "up", "--port", "0", "--state-dir",
                                         str(self.state_dir), *self.args, *extra], stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not state_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"quartctl up did not start; see {self.state_dir.parent / 'gateway.log'}")
            time.sleep(0.05)
        state = json.loads(state_file.read_text())
        self.url = state["url"]
        self.auth = aiohttp.BasicAuth(state["user"], Path(state["password_file"]).read_text().strip())

    def state(self) -> dict:
        return json.loads((self.state_dir / "up.json").read_text())

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process.pid, self.process, grace_s=30.0)
            self.process = None

    def down(self) -> None:
        """Stop it and whatever it kept (``--keep-hosts``: KeysManagers and replicas), as a user would."""
        self.stop()
        subprocess.run([sys.executable, "-m", "quart_tools.cli", "down", "--state-dir", str(self.state_dir)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


async def _functions(session: aiohttp.ClientSession, gw: Gateway) -> list[dict]:
    async with session.get(f"{gw.url}/system/functions", auth=gw.auth, timeout=aiohttp.ClientTimeout(total=2)) as r:
        return await r.json() if r.status == 200 else []


async def wait_serving(session: aiohttp.ClientSession, gw: Gateway, timeout_s: float, want: int = 0) -> float:
    """When (monotonic) every function (at least ``want`` of them) has its desired replicas available; inf
    when not within ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            fns = await _functions(session, gw)
            if len(fns) >= max(1, want) and all(f["availableReplicas"] >= f["replicas"] for f in fns):
                return time.monotonic()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        await asyncio.sleep(0.1)
    return float("inf")


async def _replica_pids(session: aiohttp.ClientSession, gw: Gateway, function: str | None = None) -> list[int]:
    """Pids of ready replicas (of ``function``, else of all; from the ports their URLs name)."""
    ports = set()
    for fn in await _functions(session, gw):
        if function is not None and fn["name"] != function:
            continue
        async with session.get(f"{gw.url}/system/replicas/{fn['name']}", auth=gw.auth) as r:
            for rep in (await r.json())["replicas"]:
                if rep["state"] == "ready":
                    ports.add(int(rep["url"].rsplit(":", 1)[1]))
    return sorted({c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid
                   and c.laddr.port in ports})
