"""Settings of the embedded gateway, with documented defaults, overridable from the environment.

Every field maps to an environment variable ``QUART_GATEWAY_<FIELD>`` (upper case); command-line
flags of `quartctl up` override both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quart_provider.callbacks import parse_networks
from quart_provider.network import DEFAULT_NIC_GBPS
from quart_provider.queue_worker import parse_codes
from quart_provider.replica_users import auto_uids
from quart_stage.settings import ConfigError, settings_from_env

DEFAULT_NAMESPACE = "openfaas-fn"
NETWORKS = ("loopback", "netns")
ASYNC_BACKENDS = ("nats", "memory")


OTHER_NAMES = {"nats_server": "QUART_NATS_SERVER", "git_sha": "QUART_GIT_SHA"}  # settings not named QUART_GATEWAY_*


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How the gateway listens, authenticates, places and proxies."""

    bind: str = "127.0.0.1"  # address the gateway listens on (loopback: a host agent never faces the network)
    port: int = 8080  # TCP port; 0 picks a free one
    provider_port: int = -1  # faas-provider API for a real OpenFaaS gateway in front; -1 = off, 0 = any port
    state_dir: Path = Path(".quart")  # credentials, sockets, pidfile, image index, logs
    namespace: str = DEFAULT_NAMESPACE  # the one function namespace (OpenFaaS's default)
    auth: bool = True  # basic auth on /system/* (OpenFaaS's basic_auth=true)
    max_body_bytes: int = 64 * 1024 * 1024  # largest request body; larger → 413
    max_deploy_bytes: int = 1024 * 1024  # largest JSON body on /system/*
    max_inflight_bytes: int = 256 * 1024 * 1024  # request-body bytes held at once by the gateway; more → 429
    max_function_inflight_bytes: int = 64 * 1024 * 1024  # … by one function or pipeline (≥ one max body); one body over → 413
    placer: str = "cache-aware"  # replica placer: cache-aware (QUART §6.2) | first-fit (quart_kernel.scheduling)
    hosts: int = 1  # simulated hosts (one KeysManager each)
    gpus_per_host: int = 4  # replica slots ("GPUs") per host
    host_memory_bytes: int = 8 * 1024**3  # parameter-cache memory per host (KeysManager --memory-limit)
    network: str = "loopback"  # loopback: KeysManagers on Unix sockets, replicas on 127.0.0.1 | netns: see docs/hosts.md
    nic_gbps: float = DEFAULT_NIC_GBPS  # netns: each host's NIC limit (tc tbf, both directions); 1 GB takes 8 s
    keysmanager_port: int = 7077  # netns: the TCP port of each host's KeysManager on the host's address
    reconcile_interval_s: float = 0.2  # how often replica states are polled and desired counts enforced
    host_timeout_s: float = 0.5  # one poll of a host (its replicas, its report); slower counts as no answer
    host_down_after_s: float = 0.8  # no answer for this long: the host is down, its replicas dead (hosts.md)
    host_down_polls: int = 2  # … and this many polls in a row unanswered (one missed poll is no outage)
    ready_probe_s: float = 0.005  # first interval of the gateway's own health probe of a starting replica
    ready_wait_s: float = 60.0  # how long an invocation waits for a first ready replica (scale from zero)
    max_waiting: int = 1024  # invocations allowed to wait for a replica per function; more → 429
    retry_after_s: int = 1  # Retry-After on 429/503
    admission_safety: float = 1.5  # a deadline admits a call whose expected time × this fits (admission.py)
    min_deadline_ms: float = 5.0  # X-Quart-Timeout-Ms below this (or below the fastest call measured): 400
    upstream_timeout_s: float = 300.0  # one proxied request to a replica
    drain_timeout_s: float = 30.0  # a replica being stopped finishes its in-flight requests and sessions within this
    peer_fetch: bool = True  # a host without a stage fetches it from hosts that hold it before the registry
    # a start that fetches parameters serves the layers held while the rest arrive; None: on where hosts have
    # addresses (network "netns"), off on loopback; true/false forces it
    live_scaling: bool | None = None
    paraserve: bool = False  # a cold stage (no host holds it) is fetched in P parts on P hosts, served as a sub-pipeline
    paraserve_slo_ms: float = 0.0  # the first response a ParaServe start must meet; 0: the fastest P
    paraserve_parts: int = 0  # force P (benchmarks); 0: the smallest P meeting paraserve_slo_ms (plan_parallelism)
    paraserve_max_parts: int = 4  # the largest P considered
    paraserve_fixed_s: float = 1.0  # a part worker's start besides its fetch (fork, runtime), overlapped with it
    paraserve_tail_s: float = 0.0  # after a part's last byte until the first answer (measured: bench paraserve)
    paraserve_fetch_gbps: float = 0.0  # one part worker's measured fetch rate (CPU, registry); 0: nic_gbps
    # generation (issue 29): with a TPOT SLO, P is chosen from both SLOs (paraserve_slo_ms is then the TTFT SLO;
    # quart_provider.scheduling.paraserve_gen.plan_generation) with these calibrated step costs of the whole stage
    paraserve_tpot_slo_ms: float = 0.0
    paraserve_decode_ms: float = 0.0  # a decode step of the whole stage
    paraserve_hop_ms: float = 0.0  # one more part on a step's path
    paraserve_prefill_ms: float = 0.0  # a typical prompt's prefill on the whole stage
    # once a group is whole it keeps as many workers as the sessions that arrived in the last window (and those
    # waiting) need (paraserve_gen.workers_to_keep): the function's desired count is raised to that
    paraserve_window_s: float = 10.0
    registry_gbps: float = 0.0  # the registry's total bandwidth shared by a cold start's fetchers; 0: unlimited
    start_timeout_s: float = 120.0  # a replica not ready after this is stopped and replaced
    async_workers: int = 16  # /async-function calls run at once (OpenFaaS queue-worker's max_inflight)
    async_queue_cap: int = 10_000  # /async-function calls accepted and waiting; more → 429
    async_timeout_s: float = 600.0  # one async call's invocation
    async_backend: str = "nats"  # nats: durable, JetStream (docs/gateway.md) | memory: in-process, lost on stop
    nats_port: int = 0  # the nats-server `up` starts, on 127.0.0.1; 0 = a free port
    async_max_attempts: int = 10  # invocations of one call before its last answer is called back
    async_initial_retry_s: float = 10.0  # first wait before a retry; doubles per attempt
    async_max_retry_wait_s: float = 120.0  # longest wait between retries
    async_retry_codes: str = "408,429,500,502,503,504"  # answers retried (a failed invocation counts as 503)
    async_ack_wait_s: float = 30.0  # a call whose worker says nothing for this long is redelivered
    callback_allowed_networks: str = ""  # CIDRs callbacks may reach though loopback/private/link-local
    callback_timeout_s: float = 10.0  # one callback POST
    callback_per_destination: int = 4  # callbacks in flight to one host:port at once
    max_functions: int = 1000  # functions per namespace; a deploy past it → 409 (deploy_limits.py)
    max_labels: int = 64  # labels (and annotations) per function; more → 400
    max_label_bytes: int = 4096  # one label's key + value; larger → 400
    replica_uids: str = "auto"  # "<first>-<last>": each function's replicas run as its own uid from this range;
    # auto: per-function uids when the gateway is root and an unprivileged user can run the venv (replica_users.py)
    nats_server: str = ""  # [QUART_NATS_SERVER] the nats-server binary; "" = beside this interpreter, else on PATH
    git_sha: str = "unknown"  # [QUART_GIT_SHA] the version /system/info shows

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise ConfigError(f"network must be one of {', '.join(NETWORKS)}, got {self.network!r}")
        if self.nic_gbps <= 0:
            raise ConfigError(f"nic_gbps must be > 0, got {self.nic_gbps}")
        if not 0 < self.max_function_inflight_bytes <= self.max_inflight_bytes:
            raise ConfigError("max_function_inflight_bytes must be > 0 and at most max_inflight_bytes")
        if min(self.max_functions, self.max_labels, self.max_label_bytes) < 1:
            raise ConfigError("max_functions, max_labels and max_label_bytes must be >= 1")
        if self.replica_uids:
            self.uid_range()  # raises ConfigError when malformed
        if (self.paraserve_parts < 0 or self.paraserve_max_parts < 1 or self.registry_gbps < 0
                or self.paraserve_tail_s < 0 or self.paraserve_fetch_gbps < 0):
            raise ConfigError("paraserve_parts must be >= 0, paraserve_max_parts >= 1, registry_gbps, "
                              "paraserve_tail_s and paraserve_fetch_gbps >= 0")
        if self.host_timeout_s <= 0 or self.host_down_after_s <= 0 or self.host_down_polls < 1:
            raise ConfigError("host_timeout_s and host_down_after_s must be > 0, host_down_polls >= 1")
        if self.async_backend not in ASYNC_BACKENDS:
            raise ConfigError(f"async_backend must be one of {', '.join(ASYNC_BACKENDS)}, got {self.async_backend!r}")
        try:
            parse_networks(self.callback_allowed_networks)
            parse_codes(self.async_retry_codes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.callback_timeout_s <= 0 or self.callback_per_destination < 1 or self.async_max_attempts < 1:
            raise ConfigError("callback_timeout_s must be > 0, callback_per_destination and async_max_attempts >= 1")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> GatewayConfig:
        """Defaults, then ``QUART_GATEWAY_*`` variables (``quart_stage.settings`` rules), then explicit
        overrides (None = keep)."""
        return settings_from_env(cls, "QUART_GATEWAY_", env, OTHER_NAMES, **overrides)

    def uid_range(self) -> range | None:
        """The uids functions' replicas run as (``replica_uids``), or None: as the gateway's user."""
        if self.replica_uids == "auto":
            return auto_uids()[0]  # quart_provider.replica_users
        if not self.replica_uids:
            return None
        first, _, last = self.replica_uids.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ConfigError(f"replica_uids must be <first>-<last>, got {self.replica_uids!r}") from None
        if not 0 < low <= high < 2**31:
            raise ConfigError(f"replica_uids must be a range of uids above 0 (never root), got {self.replica_uids!r}")
        return range(low, high + 1)

    @property
    def credentials_dir(self) -> Path:
        return self.state_dir / "secrets"

    @property
    def replica_logs_dir(self) -> Path:
        """Process replicas' stdout/stderr, one folder per function (``/system/logs``)."""
        return self.state_dir / "logs" / "replicas"

    @property
    def function_secrets_dir(self) -> Path:
        """``/system/secrets``' store (:mod:`quart_provider.secrets`), apart from the gateway's credentials."""
        return self.state_dir / "function-secrets"
