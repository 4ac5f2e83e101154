"""Host namespaces on a bridge (quart_provider.network): reachability, NIC limit, link down, cleanup.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; skips with the reason otherwise. Every test
removes what it made (the fixture's finally, and a cleanup by the cluster's prefix before it starts).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from quart_provider.network import (
    HostNetwork,
    NetworkError,
    cleanup_by_prefix,
    cluster_id,
    links,
    namespaces,
    run,
    unavailable_reason,
)

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"host namespaces unavailable: {REASON}")
RATE_GBPS = 0.1  # 100 Mbit/s: a few MB take a fraction of a second

# One server per namespace: "echo" echoes lines, "sink" counts bytes to EOF, "source N" sends N bytes.
SERVER = r"""
import socket, sys, threading
def serve(c):
    f = c.makefile("rb")
    cmd = f.readline().split()
    if cmd[0] == b"echo":
        for line in f:
            c.sendall(line)
    elif cmd[0] == b"sink":
        n = 0
        while chunk := f.read1(1 << 16):
            n += len(chunk)
        c.sendall(b"%d\n" % n)
    elif cmd[0] == b"source":
        c.sendall(b"x" * int(cmd[1]))
    c.close()
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen(64)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def _cid(name: str) -> str:
    return cluster_id(f"{Path(__file__).resolve()}:{name}")


@pytest.fixture
def net(request: pytest.FixtureRequest) -> Iterator[HostNetwork]:
    cid = _cid(request.node.name)
    try:
        with HostNetwork.create(["host-0", "host-1"], cid, nic_gbps=RATE_GBPS) as network:
            yield network
    finally:
        cleanup_by_prefix(cid)
        assert not [n for n in namespaces() if n.startswith(cid)]
        assert not [n for n in links() if n.startswith(cid)]


@pytest.fixture
def server(net: HostNetwork) -> Iterator[tuple[str, int]]:
    host = net.host("host-0")
    proc = subprocess.Popen(net.exec_argv(host, [sys.executable, "-c", SERVER, host.address]),
                            stdout=subprocess.PIPE, text=True)
    try:
        yield host.address, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def _echo(address: str, port: int, timeout: float = 2.0) -> bytes:
    with socket.create_connection((address, port), timeout=timeout) as s:
        s.sendall(b"echo\nhello\n")
        return s.makefile("rb").readline()


def test_reachable_from_root_and_from_other_host(net: HostNetwork, server: tuple[str, int]) -> None:
    address, port = server
    assert _echo(address, port) == b"hello\n"
    client = (f"import socket; s = socket.create_connection(({address!r}, {port}), timeout=2); "
              "s.sendall(b'echo\\nfrom host-1\\n'); print(s.makefile().readline(), end='')")
    out = subprocess.run(net.exec_argv("host-1", [sys.executable, "-c", client]), capture_output=True,
                         text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "from host-1\n"
    # the host's own loopback is up, and the bridge's address is the root namespace's
    lo = subprocess.run(net.exec_argv("host-1", ["ip", "-o", "addr", "show", "lo"]), capture_output=True, text=True)
    assert "127.0.0.1" in lo.stdout
    assert net.bridge_address.endswith(".1") and address != net.bridge_address


def _rate_gbps(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def test_bulk_transfer_is_limited_to_the_nic_rate(net: HostNetwork, server: tuple[str, int]) -> None:
    address, port = server
    nbytes = 3_000_000  # 0.24 s at 100 Mbit/s
    with socket.create_connection((address, port), timeout=10) as s:  # to the host: bridge-side qdisc
        s.sendall(b"sink\n")
        t0 = time.perf_counter()
        s.sendall(b"y" * nbytes)
        s.shutdown(socket.SHUT_WR)
        assert int(s.makefile("rb").readline()) == nbytes
        upload = _rate_gbps(nbytes, time.perf_counter() - t0)
    with socket.create_connection((address, port), timeout=10) as s:  # from the host: namespace-side qdisc
        s.sendall(b"source %d\n" % nbytes)
        t0 = time.perf_counter()
        got = 0
        while chunk := s.recv(1 << 16):
            got += len(chunk)
        download = _rate_gbps(got, time.perf_counter() - t0)
    assert got == nbytes
    for direction, rate in (("to the host", upload), ("from the host", download)):
        assert 0.5 * RATE_GBPS < rate < 1.2 * RATE_GBPS, f"{direction}: {rate * 1000:.0f} Mbit/s, limit 100"


def test_link_down_fails_fast_and_link_up_restores(net: HostNetwork, server: tuple[str, int]) -> None:
    address, port = server
    assert _echo(address, port) == b"hello\n"
    net.link_down("host-0")
    assert not net.link_is_up("host-0")
    t0 = time.perf_counter()
    with pytest.raises(OSError):
        _echo(address, port, timeout=0.5)
    assert time.perf_counter() - t0 < 1.0
    net.link_up("host-0")
    assert net.link_is_up("host-0")
    deadline = time.monotonic() + 5
    while True:
        try:
            assert _echo(address, port, timeout=0.5) == b"hello\n"
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_errors_name_the_cause(net: HostNetwork) -> None:
    with pytest.raises(NetworkError, match="no host named 'host-9'; hosts: host-0, host-1"):
        net.link_down("host-9")
    with pytest.raises(NetworkError, match=r"`ip link set quartnope0 up` failed \(exit \d+\): .*quartnope0"):
        run(["ip", "link", "set", "quartnope0", "up"])
    with pytest.raises(ValueError, match="nic_gbps"):
        HostNetwork.create(["h"], _cid("bad-rate"), nic_gbps=0)


def test_create_removes_leftovers_and_destroy_leaves_nothing() -> None:
    cid = _cid("leftovers")
    try:
        # what a crashed run could leave: a namespace, a root-side veth pair, a bridge with a qdisc
        run(["ip", "netns", "add", f"{cid}-host-7"])
        run(["ip", "link", "add", f"{cid}v7", "type", "veth", "peer", "name", f"{cid}n7"])
        run(["ip", "link", "add", f"{cid}br", "type", "bridge"])
        run(["tc", "qdisc", "add", "dev", f"{cid}v7", "root", "tbf", "rate", "1mbit", "burst", "32k", "latency", "50ms"])
        net = HostNetwork.create(["host-0"], cid, nic_gbps=RATE_GBPS)
        assert [n for n in namespaces() if n.startswith(cid)] == [f"{cid}-host-0"]
        assert sorted(n for n in links() if n.startswith(cid)) == [f"{cid}br", f"{cid}v0"]
        assert net.to_json() == HostNetwork.from_json(net.to_json()).to_json()
        net.destroy()
        assert not [n for n in namespaces() if n.startswith(cid)]
        assert not [n for n in links() if n.startswith(cid)]
        assert cid not in run(["tc", "qdisc", "show"]).stdout
    finally:
        cleanup_by_prefix(cid)
