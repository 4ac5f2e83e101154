"""Settings of one KeysManager host agent: dataclass defaults, overridable from the environment (KM_*)."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from quart_stage.settings import setting, settings_from_env

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def default_state_root() -> Path:
    """Where every KeysManager on this machine keeps its state dir: $XDG_RUNTIME_DIR or the temp dir."""
    base = setting("XDG_RUNTIME_DIR", str, "") or tempfile.gettempdir()
    return Path(base) / f"quart-keysmanager-{os.getuid()}"


@dataclass(frozen=True, slots=True)
class KeysManagerConfig:
    """One host agent. Every field has a documented default (docs/keysmanager.md)."""

    name: str = "host-0"  # host name in reports; also names the state dir and shared-memory files
    socket: str = ""  # Unix socket of the API (mode 0600); default <state_dir>/km.sock
    state_dir: str = ""  # pidfile, state.json, process logs; default <default_state_root()>/<name>
    shm_dir: str = "/dev/shm"  # where parameter segments live (tmpfs: shared, not swapped to disk)
    memory_limit: int = 0  # bytes of parameters this host may hold; 0 = derive from memory_threshold
    memory_threshold: float = 0.85  # evict when the machine's memory use (psutil) crosses this fraction
    gpus: int = 0  # GPU slots of this (simulated) host; 0 = CPU host, replicas take no slot
    pin_cpus: bool = True  # set each replica's CPU affinity to `cpus` cores (round robin)
    fork_mode: str = "cow"  # default replica mode: cow (share parameter pages) | isolated (private copy)
    preload: bool = True  # zygotes fork from a preloader that imported torch & co once (else: fresh interpreters)
    cache_on_cold: bool = True  # after a cold start, also cache the stage (leave a zygote behind)
    ready_timeout_s: float = 180.0  # a replica not healthy by then is killed and reported dead
    zygote_timeout_s: float = 600.0  # loading parameters into a zygote
    drain_timeout_s: float = 30.0  # stop: wait this long for in-flight requests, then SIGKILL
    landing_mb: int = 0  # MiB of pages kept touched in the state dir for the next stage file (keysmanager.landing)
    part_read_timeout_s: float = 10.0  # a part start's ranged read from a peer: silent this long, try the next source
    monitor_interval_s: float = 0.1  # reaping and memory-pressure checks
    max_replicas_per_call: int = 256
    python: str = ""  # interpreter for zygotes and cold replicas; default sys.executable
    listen: str = ""  # HOST:PORT: also serve the API on TCP, only with the bearer token of token_file
    token_file: str = ""  # the bearer token TCP clients must send (mode 0600); required with listen
    host_address: str = "127.0.0.1"  # the host's address: replicas listen on it and report URLs with it

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"host name {self.name!r} must be 1-63 letters, digits, '_', '.', '-'")
        if not 0.0 < self.memory_threshold <= 1.0:
            raise ValueError("memory_threshold must be in (0, 1]")
        if self.memory_limit < 0 or self.gpus < 0 or self.landing_mb < 0:
            raise ValueError("memory_limit, gpus and landing_mb must be >= 0")
        if self.fork_mode not in ("cow", "isolated"):
            raise ValueError("fork_mode must be 'cow' or 'isolated'")
        if self.listen:
            self.listen_address  # noqa: B018 - validates HOST:PORT
            if not self.token_file:
                raise ValueError("listen needs token_file: the API is never served on TCP without a token")
        try:
            ipaddress.ip_address(self.host_address)
        except ValueError:
            raise ValueError(f"host_address must be an IP address, got {self.host_address!r}") from None

    @property
    def listen_address(self) -> tuple[str, int]:
        """``listen`` as (host, port)."""
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"listen must be HOST:PORT (port 1-65535), got {self.listen!r}")
        return host, int(port)

    @property
    def state_path(self) -> Path:
        """The state dir: explicit, else beside an explicit socket (``<socket>.d``), else per host name."""
        if self.state_dir:
            return Path(self.state_dir)
        if self.socket:
            return Path(self.socket).with_name(Path(self.socket).name + ".d")
        return default_state_root() / self.name

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else self.state_path / "km.sock"

    @property
    def shm_prefix(self) -> str:
        """File-name prefix of this host's parameter segments (a restart removes what matches it)."""
        tag = hashlib.sha256(str(self.state_path.resolve()).encode()).hexdigest()[:8]
        return f"quart-km-{self.name}-{tag}-"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> KeysManagerConfig:
        """Defaults, then KM_<FIELD> variables (e.g. KM_MEMORY_LIMIT=2000000000), then ``overrides``
        (``None`` keeps the value). Raises ``quart_stage.settings.ConfigError`` (a ValueError)."""
        return settings_from_env(cls, "KM_", env, **overrides)
