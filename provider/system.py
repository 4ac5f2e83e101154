"""Everything `quartctl up` runs, as one object: KeysManagers (one per host), the gateway, its site.

Used by the CLI (foreground or detached), by `quartctl demo` and by tests (in-process, port 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quart_provider.adopt import AdoptedProcess, live_keysmanager
from quart_provider.async_service import DurableAsync
from quart_provider.config import GatewayConfig
from quart_provider.deployment import FunctionDeployment
from quart_provider.gateway import EmbeddedGateway
from quart_provider.hosts import Host, ProcessHost
from quart_provider.network import HostNetwork, cluster_id
from quart_provider.phases import Phases
from quart_provider.routes import create_app, start_site
from quart_provider.stack import Stack
from quart_provider.store import write_private
from quart_provider.supervisor import Backoff, supervise
from quart_transport.auth import Credentials, keysmanager_token_file, load_or_create

from keysmanager.client import AsyncKeysManagerClient
from keysmanager.config import KeysManagerConfig
from keysmanager.recovery import clean_leftovers
from keysmanager.sysutil import return_large_buffers, set_parent_death_signal

log = logging.getLogger("quart.up")
STATE_FILE = "up.json"
PluginAttach = Callable[[EmbeddedGateway, Any], Awaitable[Any] | None]  # e.g. gateway_plugin.plugin.attach


def keysmanager_available() -> bool:
    try:
        importlib.import_module("keysmanager.daemon")
    except ImportError:
        return False
    return True


@dataclass(slots=True)
class _Agent:
    name: str
    endpoint: str  # Unix socket path (loopback) or http://<host address>:<port> (netns)
    process: subprocess.Popen | AdoptedProcess  # AdoptedProcess: a kept KeysManager of an earlier gateway
    argv: list[str] = field(default_factory=list)  # how to start it again (the supervisor)
    log_path: Path | None = None
    socket: Path | None = None
    backoff: Backoff = field(default_factory=Backoff)
    restarts: int = 0


def _spawn(argv: list[str], log_path: Path, outlive: bool = False) -> subprocess.Popen:
    """Start a KeysManager; it dies with this process unless ``outlive`` (kept hosts, :mod:`.adopt`)."""
    with open(log_path, "ab") as logfile:
        return subprocess.Popen(argv, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=None if outlive else set_parent_death_signal)


@dataclass(slots=True)
class EmbeddedSystem:
    """Gateway + hosts. ``await start()``, then ``url`` / ``credentials``; ``await stop()`` stops all of it."""

    config: GatewayConfig
    use_keysmanager: bool | None = None  # None: when keysmanager.daemon exists
    plugin: PluginAttach | None = None  # given by the composition root (quartctl up): the platform names no plugin
    gateway: EmbeddedGateway | None = None
    credentials: Credentials | None = None
    port: int = 0
    provider_port: int | None = None
    agents: list[_Agent] = field(default_factory=list)
    network: HostNetwork | None = None  # netns mode: the host namespaces and bridge
    hold_queue: bool = False  # True: async calls wait for start_queue_worker() (after a stack is deployed)
    keep_hosts: bool = False  # True: KeysManagers and replicas outlive stop(); the next start adopts them (adopt.py)
    durable: DurableAsync | None = None  # nats-server, stream and queue worker (async_backend=nats)
    _runner: Any = None
    _provider_runner: Any = None
    _supervisor: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.bind}:{self.port}"

    @property
    def state_file(self) -> Path:
        return self.config.state_dir / STATE_FILE

    async def start(self) -> None:
        cfg = self.config
        return_large_buffers()  # freed request bodies leave the RSS (admission bounds bytes, not the heap's habits)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(cfg.state_dir, 0o700)  # credentials, sockets, logs, stored functions: the gateway's user only
        (cfg.state_dir / "logs").mkdir(exist_ok=True)
        self.credentials = load_or_create(cfg.credentials_dir)
        use_km = keysmanager_available() if self.use_keysmanager is None else self.use_keysmanager
        phases = Phases()
        try:
            hosts = await self._start_hosts(use_km)
            phases.mark("hosts")
            self.gateway = EmbeddedGateway(cfg, hosts)
            self.gateway.keep_replicas = self.keep_hosts
            if cfg.async_backend == "nats":
                self.durable = DurableAsync(cfg)
                await self.durable.connect(self.gateway)
                phases.mark("nats")
            app = create_app(self.gateway, self.credentials if cfg.auth else None)
            self._runner, self.port = await start_site(app, cfg.bind, cfg.port)
            phases.mark("site+restore")
            if cfg.provider_port >= 0:
                provider_app = create_app(self.gateway, self.credentials if cfg.auth else None, provider=True)
                self._provider_runner, self.provider_port = await start_site(provider_app, cfg.bind,
                                                                             cfg.provider_port)
            if self.plugin is not None:
                result = self.plugin(self.gateway, app)
                if inspect.isawaitable(result):
                    await result
                phases.mark("plugin")
            if not self.hold_queue:
                await self.start_queue_worker()
        except BaseException:
            await self.stop()
            raise
        self._write_state()
        log.info("started in %s", phases)

    async def start_queue_worker(self) -> None:
        """Start running accepted async calls (those stored before a restart included)."""
        if self.durable is not None and self.gateway is not None:
            host = "127.0.0.1" if self.config.bind in ("0.0.0.0", "::", "") else self.config.bind
            host = f"[{host}]" if ":" in host else host
            await self.durable.start_worker(self.gateway, f"http://{host}:{self.port}")

    async def _start_hosts(self, use_km: bool) -> list[Host]:
        cfg = self.config
        names = [f"host-{i}" for i in range(cfg.hosts)]
        if not use_km:
            if cfg.network == "netns":
                raise RuntimeError("--network netns runs a KeysManager inside each host's namespace: it needs "
                                   "KeysManagers (drop --process-hosts)")
            log.warning("hosts without KeysManagers: only process runnables (quart/echo) can run")
            return [ProcessHost(n, cfg.gpus_per_host, cfg.host_memory_bytes, log_dir=cfg.replica_logs_dir) for n in names]
        from quart_provider.keysmanager_host import KeysManagerHost

        if cfg.network == "netns":
            self.network = await asyncio.to_thread(HostNetwork.create, names, cluster_id(str(cfg.state_dir)),
                                                   cfg.nic_gbps)
            token_file = keysmanager_token_file(cfg.credentials_dir)
            token = token_file.read_text().strip()
        else:
            token = None
        sockets_dir = cfg.state_dir / "sockets"
        sockets_dir.mkdir(exist_ok=True)
        os.chmod(sockets_dir, 0o700)
        for name in names:
            sock = sockets_dir / f"{name}.sock"
            kept = live_keysmanager(sock) if self.network is None else None
            if kept is not None and self.keep_hosts:  # a kept host of the gateway before this one: talk to it again
                self.agents.append(_Agent(name, str(sock), AdoptedProcess(kept), self._km_argv(name, sock),
                                          cfg.state_dir / "logs" / f"{name}.log", sock))
                continue
            if kept is not None:  # kept by an earlier gateway, not by this one: stopped (its replicas with it)
                await asyncio.to_thread(stop_process, kept)
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()
            argv = self._km_argv(name, sock)
            endpoint = str(sock)
            if self.network is not None:  # inside the host's namespace, on its address, with the cluster token
                address = self.network.host(name).address
                endpoint = f"http://{address}:{cfg.keysmanager_port}"
                argv = self.network.exec_argv(name, [*argv, "--listen", f"{address}:{cfg.keysmanager_port}",
                                                     "--token-file", str(token_file), "--host-address", address])
            log_path = cfg.state_dir / "logs" / f"{name}.log"
            self.agents.append(_Agent(name, endpoint, _spawn(argv, log_path, self.keep_hosts), argv, log_path, sock))
        hosts = [KeysManagerHost(a.name, AsyncKeysManagerClient(a.endpoint, token=token), cfg.gpus_per_host,
                                 cfg.host_memory_bytes, log_dir=cfg.replica_logs_dir,
                                 km_logs=sockets_dir / f"{a.name}.sock.d" / "logs")  # KeysManagerConfig.state_path
                 for a in self.agents]
        try:
            await self._wait_agents(hosts)
        except BaseException:
            await asyncio.gather(*(h.close() for h in hosts), return_exceptions=True)
            raise
        now = time.monotonic()
        for agent in self.agents:
            agent.backoff.started(now)
        self._supervisor = asyncio.create_task(supervise(self.agents, self._restart_agent, exited=self._agent_exited),
                                               name="supervise")
        return hosts

    def _km_argv(self, name: str, sock: Path) -> list[str]:
        cfg = self.config
        return [sys.executable, "-m", "keysmanager.daemon", "--socket", str(sock), "--name", name,
                "--memory-limit", str(cfg.host_memory_bytes), "--gpus", str(cfg.gpus_per_host)]

    def _agent_exited(self, agent: _Agent) -> None:
        """Its host's replicas are dead to routing now, not after ``host_down_after_s`` of silence."""
        if self.gateway is not None:
            self.gateway.reconciler.host_lost(agent.name, RuntimeError(
                f"KeysManager exited with {agent.process.returncode}"))

    def _restart_agent(self, agent: _Agent) -> None:
        """Start a successor of an exited KeysManager on the same socket and state folder (it cleans up after
        its predecessor); the state file names its pid for `quartctl down`."""
        if agent.socket is not None:
            with contextlib.suppress(FileNotFoundError):
                agent.socket.unlink()
        agent.process = _spawn(agent.argv, agent.log_path, self.keep_hosts)
        agent.restarts += 1
        self._write_state()

    async def _wait_agents(self, hosts: list[Any]) -> None:
        cfg = self.config
        deadline = time.monotonic() + 60
        for agent, host in zip(self.agents, hosts, strict=True):
            while True:
                if agent.process.poll() is not None:
                    raise RuntimeError(f"KeysManager {agent.name} exited with {agent.process.returncode}; see "
                                       f"{cfg.state_dir / 'logs' / (agent.name + '.log')}")
                try:
                    await host.client.health()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"KeysManager {agent.name} did not answer on {agent.endpoint} in 60 s") from None
                    await asyncio.sleep(0.1)

    def _write_state(self) -> None:
        state = {
            "pid": os.getpid(), "url": self.url, "port": self.port,
            "provider_url": f"http://{self.config.bind}:{self.provider_port}" if self.provider_port else None,
            "password_file": str(self.credentials.password_file) if self.credentials else None,
            "user": self.credentials.user if self.credentials else None,
            "hosts": [{"name": a.name, "endpoint": a.endpoint, "pid": a.process.pid,
                       "socket": str(a.socket) if a.socket else None, "restarts": a.restarts} for a in self.agents],
            "network": self.network.to_json() if self.network else None,
            "nats": {"pid": self.durable.pid} if self.durable is not None and self.durable.pid else None,
        }
        write_private(self.state_file, json.dumps(state, indent=2).encode())

    async def deploy_stack(self, stack: Stack) -> list[str]:
        """Deploy (or update) every function of a stack in-process; returns one line per function."""
        assert self.gateway is not None
        self.gateway.images.register(stack.image_index_entries())
        lines = []
        for function in stack.functions:
            deployment = FunctionDeployment.from_json(function.request, self.config.namespace)
            if function.name in self.gateway.functions:
                await self.gateway.registry.update(deployment)
                lines.append(f"Updated {function.name}: {self.url}/function/{function.name}")
            else:
                await self.gateway.registry.deploy(deployment)
                lines.append(f"Deployed {function.name}: {self.url}/function/{function.name}")
        return lines

    async def wait_ready(self, names: list[str], timeout_s: float = 300.0) -> None:
        """Wait until each named function has all its desired replicas ready."""
        assert self.gateway is not None
        deadline = time.monotonic() + timeout_s
        while True:
            pending = [n for n in names if len(self.gateway.functions[n].ready) < self.gateway.functions[n].desired]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout_s:.0f} s: {', '.join(pending)}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Stop the KeysManagers' supervisor, the async worker (calls not finished stay queued), the site (which
        stops every replica), the KeysManagers, the nats-server; remove the state file."""
        if self._supervisor is not None:  # nothing is restarted from here on
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        if self.durable is not None:
            await self.durable.stop_worker(min(10.0, self.config.drain_timeout_s))
        if self._provider_runner is not None:
            await self._provider_runner.cleanup()
            self._provider_runner = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        elif self.gateway is not None:
            await self.gateway.close()
        for agent in self.agents:
            if not self.keep_hosts:
                stop_process(agent.process.pid, agent.process)
                if agent.socket is not None:  # replicas told to survive their KeysManager: stopped with it here
                    await asyncio.to_thread(clean_leftovers, KeysManagerConfig(name=agent.name, socket=str(agent.socket)))
        self.agents.clear()
        if self.durable is not None:
            await self.durable.stop(0)
            self.durable = None
        if self.network is not None:
            await asyncio.to_thread(self.network.destroy)
            self.network = None
        with contextlib.suppress(FileNotFoundError):  # kept hosts: left for `quartctl down` (their pids)
            if not self.keep_hosts and self.state_file.exists() and \
                    json.loads(self.state_file.read_text()).get("pid") == os.getpid():
                self.state_file.unlink()


def stop_process(pid: int, process: subprocess.Popen | None = None, grace_s: float = 10.0) -> bool:
    """SIGTERM a process (and its process group when it leads one), SIGKILL after ``grace_s``.

    The pid itself is always signalled: a gateway started under ``timeout`` or a shell job is not a
    group leader, and ``killpg`` on its pid fails with "no such process" while it keeps running.
    Reaps it when it is our child. Returns True once the process is gone.
    """
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not _signal(pid, sig):
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if process is not None:
                if process.poll() is not None:
                    return True
            elif not _alive(pid):
                return True
            time.sleep(0.05)
    if process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=1)
        return process.poll() is not None
    return not _alive(pid)


def _signal(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` and, when it leads a process group, to that group; False if it is gone."""
    try:
        leader = os.getpgid(pid) == pid
    except ProcessLookupError:
        return False
    if leader:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
