"""Data shared by the KeysManager daemon, its clients and the simulator: specs, replica and host snapshots.

Plain dataclasses with ``to_dict`` / ``from_dict`` so they travel as JSON over the daemon's Unix-socket API.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

ReplicaState = Literal["starting", "ready", "draining", "dead"]
ReplicaSource = Literal["fork", "cold"]
ForkMode = Literal["cow", "isolated"]
FORK_MODES: tuple[str, ...] = ("cow", "isolated")
# how a replica starts: "auto" forks from the zygote when one is cached and cold-starts otherwise; "cold" always
# cold-starts (the function runs without the KeysManager's parameter cache)
START_SOURCES: tuple[str, ...] = ("auto", "cold")
# where a replica listens: "tcp" on the host address (port 0), or "unix" on a socket beside the API socket (a
# stage pod on Kubernetes reaches it through the mounted socket folder: quart_stage.forward)
LISTEN_KINDS: tuple[str, ...] = ("tcp", "unix")
# how the scheduler planned a start (quart_kernel.scheduling.starts.StartMode, the same words), and what the
# KeysManager did: "fork" from a zygote cached here; "peer" / "multicast" / "live" / "paraserve" fetched from the
# peers named (a live or part start serving while the bytes arrive); "cold" loaded from the registry or the disk
START_MODES: tuple[str, ...] = ("gpu", "fork", "peer", "multicast", "live", "cold", "paraserve")
StartPath = Literal["fork", "peer", "multicast", "live", "cold", "paraserve"]


def _from_dict(cls, data: dict[str, Any]):
    """Build dataclass ``cls`` from ``data``, ignoring keys it does not know (newer servers may add fields)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What to run: one stage function and the environment it was deployed with.

    ``env`` is the deployed environment (``QUART_MODEL_DIR``, ``QUART_STAGE_INDEX``, ``QUART_COMPUTE``, ...),
    read by ``quart_stage.config.StageConfig.from_env``. ``cpus`` is the CPU budget of one replica (torch
    threads and, when pinning is on, the number of cores in its affinity mask). ``memory_bytes`` is advisory.
    """

    function: str
    env: dict[str, str] = field(default_factory=dict)
    cpus: float = 1.0
    memory_bytes: int = 0
    concurrency: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageSpec:
        return _from_dict(cls, data)


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """One replica as the KeysManager sees it now."""

    id: str
    function: str
    host: str
    pid: int
    port: int
    url: str
    state: ReplicaState
    source: ReplicaSource
    ready_ms: float | None = None  # from the start request to the first healthy answer
    rss_bytes: int = 0
    pss_bytes: int = 0
    mode: ForkMode = "cow"
    survive: bool = False  # keeps running when the KeysManager dies
    gpu_slot: int | None = None
    exit_status: int | None = None  # set once dead: exit code, or -signal
    layers: list[int] | None = None  # the stage's layer range [S, E] (half-open, absolute); None without a manifest
    layers_held: list[int] | None = None  # [A, B]: the layers it can run now (a full replica: == layers)
    live: bool = False  # started live and not yet holding its whole stage (keysmanager.live)
    socket: str | None = None  # its Unix socket (started with listen="unix": a stage pod forwards to it), else None
    phases_ms: dict[str, float] | None = None  # start phase → ms after the start request it ended (live starts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaInfo:
        return _from_dict(cls, data)


@dataclass(frozen=True, slots=True)
class ZygoteInfo:
    """A cached stage: the zygote process holding its parameters in shared memory."""

    function: str
    pid: int
    param_bytes: int
    sha256: str
    shm_path: str
    load_ms: float
    last_used: float  # monotonic seconds of the last ensure_cached/start that used it (LRU key)
    live_replicas: int
    threads: int  # threads of the zygote process: 1 (safe to fork)
    rss_bytes: int = 0
    pss_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ZygoteInfo:
        return _from_dict(cls, data)


@dataclass(frozen=True, slots=True)
class HostReport:
    """What the scheduler needs from one host (see quart_kernel.scheduling.types.HostView)."""

    name: str
    cached: list[str]  # stage functions with a zygote here
    memory_used: int  # parameter bytes held in host memory (shared segments + isolated copies)
    memory_limit: int  # bytes the KeysManager may use for cached parameters
    gpu_slots: int
    gpu_used: int
    replicas: int = 0  # live replicas
    host_memory_percent: float = 0.0  # psutil reading of the whole machine
    held: list[str] = field(default_factory=list)  # registry stages whose verified files are here (peers fetch them)

    @property
    def gpu_free(self) -> int:
        return max(0, self.gpu_slots - self.gpu_used)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostReport:
        return _from_dict(cls, data)


@dataclass(frozen=True, slots=True)
class StartOrder:
    """One start as the scheduler planned it (``quart_kernel.scheduling.starts.StartPlan``, with its peers as
    KeysManager addresses), carried out whole by one ``POST /v1/starts`` (``keysmanager.starts``).

    ``mode``: the plan's mode; ``peers``: the addresses to fetch from, in order (then the registry); ``layers``:
    a ParaServe part ``(a, b)`` to fetch and serve first; ``cache``: False for a function deployed without the
    parameter cache (``com.quart.keysmanager: off``): every replica loads on its own and nothing is cached."""

    mode: str
    peers: tuple[str, ...] = ()
    layers: tuple[int, int] | None = None
    cache: bool = True
    count: int = 1

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"mode": self.mode, "peers": list(self.peers), "cache": self.cache,
                                "count": self.count}
        if self.layers is not None:
            body["layers"] = list(self.layers)
        return body


@dataclass(frozen=True, slots=True)
class StartReport:
    """What a ``StartOrder`` did: its ``path`` (``StartPath``), and when that is not the plan's mode, the
    ``fallback``'s reason (the stage was cached here meanwhile, no zygote was left to fork, no peer address, the
    stage was local already, ...); the replicas started (each still starting: the gateway's probe routes it)."""

    planned: str
    path: StartPath
    replicas: list[ReplicaInfo]
    fallback: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"planned": self.planned, "path": self.path, "fallback": self.fallback,
                "replicas": [r.to_dict() for r in self.replicas]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StartReport:
        return cls(data["planned"], data["path"], [ReplicaInfo.from_dict(r) for r in data["replicas"]],
                   data.get("fallback", ""))
