"""Hosts on real addresses: one Linux network namespace per host, all on one bridge, NICs rate-limited.

::

    root namespace (gateway)                    host namespaces
    bridge <cid>br  10.R.S.1/24 ──veth <cid>v0── eth0 10.R.S.2  (netns <cid>-host-0)
                                 ──veth <cid>v1── eth0 10.R.S.3  (netns <cid>-host-1)

Each host's NIC is limited with a ``tc`` token bucket (tbf) on both directions of its veth: egress of
the namespace side (what the host sends) and egress of the bridge side (what it receives). Everything
is done with iproute2 (``ip``, ``tc``) through subprocess; a failing command raises
:class:`NetworkError` naming the command and its stderr.

Every name carries the cluster id ``<cid>`` (``q`` + 5 hex digits, see :func:`cluster_id`), so
:func:`cleanup_by_prefix` removes exactly one cluster's namespaces, links and (with them) qdiscs,
including the leftovers of a crashed earlier run with the same id. Interface names stay within
Linux's 15 characters (``<cid>v<index>`` ≤ 10).

Default NIC rate: 1 Gbit/s, so fetching a 1 GB stage takes 8 s. Slow enough that moving parameters
is visible and measurable next to a fork in milliseconds; fast enough that a benchmark's cold starts
take seconds, not minutes; and low enough that the limit, not the CPU, sets the rate on the 2-core
development machine, where one Python TCP stream across an *unlimited* veth reaches only 1.7-2.4
Gbit/s (so a 2 Gbit/s limit would measure the CPU). ``--nic-gbps`` sets it per cluster.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_NIC_GBPS = 1.0
_NETNS_DIR = "/run/netns"
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21  # `ip netns add` mounts the namespace file
_SUBNETS = ipaddress.ip_network("10.200.0.0/13")  # private /24s are picked from here
_TBF_LATENCY_MS = 20
_MAX_HOSTS = 250
# A new namespace caps TCP autotuning at 6 MB; with the tbf queue delaying data one way and ACKs the other
# (a host that sends and receives at once: a chain multicast's forwarder) one stream then stays near 0.6 Gbit/s.
# 32 MB covers 1 Gbit/s × 2 × the queue's delay many times over, as on hosts tuned for bulk transfer.
_TCP_BUFFERS = ["net.ipv4.tcp_rmem=4096 131072 33554432", "net.ipv4.tcp_wmem=4096 16384 33554432"]


class NetworkError(RuntimeError):
    """An ``ip``/``tc`` command failed, or a host name is unknown."""


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (None when they can): no ``ip``/``tc``, no CAP_NET_ADMIN."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    try:
        with open("/proc/self/status") as fh:
            caps = int(next(line.split()[1] for line in fh if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        return "cannot read this process's capabilities from /proc/self/status"
    for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if not caps >> bit & 1:
            return f"network namespaces need root ({name} missing; running as uid {os.geteuid()})"
    return None


def cluster_id(key: str) -> str:
    """A short, stable id for a cluster (``q`` + 5 hex digits) derived from ``key`` (e.g. the state dir).

    The same key gives the same id, so a new run removes the leftovers of a crashed one with it.
    """
    return "q" + hashlib.sha256(key.encode()).hexdigest()[:5]


def run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one iproute2 command; raise :class:`NetworkError` with the command and its stderr on failure."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if check and proc.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    """Names of the network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def links() -> list[str]:
    """Interface names of the root namespace (``ip -o link show``), without ``@peer`` suffixes."""
    names = []
    for line in run(["ip", "-o", "link", "show"]).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def cleanup_by_prefix(prefix: str) -> list[str]:
    """Delete every namespace and root-namespace link whose name starts with ``prefix``; returns what went.

    Deleting a namespace deletes its veth end, and with it the peer and both qdiscs; the bridge and
    any veth left in the root namespace by an interrupted create go by name.
    """
    if len(prefix) < 3:
        raise ValueError(f"prefix {prefix!r} is too short to delete by")
    removed = []
    for ns in namespaces():
        if ns.startswith(prefix):
            run(["ip", "netns", "delete", ns], check=False)
            removed.append(f"netns {ns}")
    for name in links():
        if name.startswith(prefix):
            run(["ip", "link", "delete", name], check=False)
            removed.append(f"link {name}")
    return removed


def tbf_args(gbps: float) -> list[str]:
    """``tc`` tbf parameters for a NIC of ``gbps``: the bucket holds 10 ms of traffic (≥ 64 KiB, a GSO
    packet; smaller buckets leave TCP below the rate on a busy machine) and the queue
    ``_TBF_LATENCY_MS`` of it."""
    if gbps <= 0:
        raise ValueError(f"nic_gbps must be > 0, got {gbps}")
    bits = int(gbps * 1e9)
    burst = max(64 * 1024, bits // 8 // 100)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", f"{_TBF_LATENCY_MS}ms"]


@dataclass(frozen=True, slots=True)
class NetHost:
    """One host: its namespace, its address on the bridge and the root-side end of its veth."""

    name: str
    index: int
    netns: str
    address: str
    veth: str


@dataclass(slots=True)
class HostNetwork:
    """N hosts on one bridge. ``create`` builds it (after removing leftovers of the same id); ``destroy``
    removes all of it. Also a context manager: ``with HostNetwork.create(...) as net``."""

    cluster_id: str
    subnet: str  # e.g. 10.203.17.0/24; the bridge holds .1, host i holds .(i + 2)
    nic_gbps: float
    hosts: list[NetHost] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.cluster_id}br"

    @property
    def bridge_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet).network_address + 1)

    @classmethod
    def create(cls, names: Iterable[str], cid: str, nic_gbps: float = DEFAULT_NIC_GBPS) -> HostNetwork:
        names = list(names)
        if not 0 < len(names) <= _MAX_HOSTS:
            raise ValueError(f"hosts must be 1..{_MAX_HOSTS}, got {len(names)}")
        shape = tbf_args(nic_gbps)  # validates the rate before touching anything
        reason = unavailable_reason()
        if reason:
            raise NetworkError(f"cannot create host namespaces: {reason}")
        cleanup_by_prefix(cid)
        net = cls(cid, _free_subnet(cid), nic_gbps)
        try:
            net._build(names, shape)
        except BaseException:
            cleanup_by_prefix(cid)
            raise
        return net

    def _build(self, names: list[str], shape: list[str]) -> None:
        prefix = ipaddress.ip_network(self.subnet).prefixlen
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{self.bridge_address}/{prefix}", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])
        base = ipaddress.ip_network(self.subnet).network_address
        for i, name in enumerate(names):
            host = NetHost(name, i, f"{self.cluster_id}-{name}", str(base + i + 2), f"{self.cluster_id}v{i}")
            inner = f"{self.cluster_id}n{i}"
            ns = ["ip", "-n", host.netns]
            run(["ip", "netns", "add", host.netns])
            run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", inner])
            run(["ip", "link", "set", inner, "netns", host.netns])
            run([*ns, "link", "set", inner, "name", "eth0"])
            run([*ns, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0"])
            run([*ns, "link", "set", "lo", "up"])
            run(["ip", "netns", "exec", host.netns, "sysctl", "-q", "-w", *_TCP_BUFFERS])
            run([*ns, "link", "set", "eth0", "up"])
            run([*ns, "route", "add", "default", "via", self.bridge_address])
            run(["ip", "link", "set", host.veth, "master", self.bridge])
            run(["ip", "link", "set", host.veth, "up"])
            run(["tc", *ns[1:], "qdisc", "add", "dev", "eth0", "root", *shape])  # what the host sends
            run(["tc", "qdisc", "add", "dev", host.veth, "root", *shape])  # what the host receives
            self.hosts.append(host)

    def destroy(self) -> None:
        """Remove the namespaces, veths, bridge and qdiscs of this cluster (idempotent)."""
        cleanup_by_prefix(self.cluster_id)

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def host(self, name: str) -> NetHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise NetworkError(f"no host named {name!r}; hosts: {', '.join(h.name for h in self.hosts)}")

    def exec_argv(self, host: str | NetHost, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the host's namespace."""
        h = host if isinstance(host, NetHost) else self.host(host)
        return ["ip", "netns", "exec", h.netns, *argv]

    def link_down(self, host: str | NetHost) -> None:
        """Pull the host's cable: its veth goes down on the bridge side (nothing in or out; peers see silence)."""
        h = host if isinstance(host, NetHost) else self.host(host)
        run(["ip", "link", "set", h.veth, "down"])

    def link_up(self, host: str | NetHost) -> None:
        h = host if isinstance(host, NetHost) else self.host(host)
        run(["ip", "link", "set", h.veth, "up"])

    def set_rate(self, host: str | NetHost, gbps: float) -> None:
        """Change the host's NIC limit, both directions (e.g. a registry host faster or slower than the rest)."""
        h = host if isinstance(host, NetHost) else self.host(host)
        shape = tbf_args(gbps)
        run(["tc", "-n", h.netns, "qdisc", "replace", "dev", "eth0", "root", *shape])
        run(["tc", "qdisc", "replace", "dev", h.veth, "root", *shape])

    def link_is_up(self, host: str | NetHost) -> bool:
        h = host if isinstance(host, NetHost) else self.host(host)
        return ",UP" in run(["ip", "-o", "link", "show", h.veth]).stdout.split(">")[0]

    def to_json(self) -> dict[str, Any]:
        return {"cluster_id": self.cluster_id, "subnet": self.subnet, "nic_gbps": self.nic_gbps,
                "hosts": [asdict(h) for h in self.hosts]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostNetwork:
        return cls(data["cluster_id"], data["subnet"], float(data["nic_gbps"]),
                   [NetHost(**h) for h in data["hosts"]])


def _free_subnet(cid: str) -> str:
    """A /24 of ``_SUBNETS`` that no root-namespace address uses, starting at one derived from ``cid``."""
    used = []
    for line in run(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
        with contextlib.suppress(ValueError, IndexError):
            used.append(ipaddress.ip_interface(line.split()[3]).network)
    subnets = list(_SUBNETS.subnets(new_prefix=24))
    start = int(cid[1:], 16) % len(subnets)
    for k in range(len(subnets)):
        candidate = subnets[(start + k) % len(subnets)]
        if not any(candidate.overlaps(u) for u in used):
            return str(candidate)
    raise NetworkError(f"no free /24 left in {_SUBNETS}")
