"""Issue 14 item 3: admission by bytes and by time.

Reproducers: 429s carried ``Retry-After: 1`` while accepted requests waited 37.6 s; bodies in flight
were bounded by count only; a chunked body was not counted. Here: the byte gate's 413/429 and its
Retry-After from the measured drain rate, a slow chunked body holding its bytes against a second
request, and a request refused at entry when its expected wait exceeds its deadline.
"""

from __future__ import annotations

import socket
import time

import pytest
import requests
from quart_kernel.admission import StageLoad, admit_by_time, expected_wait_s
from quart_provider.body_gate import ByteGate, Reservation
from quart_stage.errors import QuartError
from support.embedded_system import ThreadedSystem
from support.faas_cli import Running, busy_function, faas_cli_deploy_body


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_byte_gate_bounds_per_key_and_total_with_retry_after_from_the_drain_rate():
    clock = Clock()
    gate = ByteGate(total_limit=1000, key_limit=600, clock=clock, fallback_retry_s=2)
    a = Reservation(gate, "f")
    a.add(500)
    with pytest.raises(QuartError) as err:
        Reservation(gate, "f").add(200)  # f would hold 700 > 600: not now
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "2"  # nothing drained yet: fallback
    b = Reservation(gate, "g")
    b.add(400)
    with pytest.raises(QuartError) as err:
        Reservation(gate, "h").add(200)  # the gateway would hold 1100 > 1000
    assert err.value.status == 429 and "gateway" in err.value.message
    with pytest.raises(QuartError) as err:
        Reservation(gate, "h").add(601)  # never fits
    assert err.value.status == 413 and err.value.field == "body"
    piecewise = Reservation(gate, "k")  # a chunked body: its pieces add up to the same bound
    with pytest.raises(QuartError) as err:
        for _ in range(7):
            piecewise.add(90)
    assert err.value.status in (413, 429)
    piecewise.close()
    clock.now += 1.0
    a.close()  # 500 bytes drained in the last second: 500 B/s
    b.close()
    a.close()  # idempotent
    assert gate.total == 0 and gate.held == {}
    clock.now += 1.0
    c = Reservation(gate, "f")
    c.add(600)
    with pytest.raises(QuartError) as err:
        Reservation(gate, "f").add(600)  # 600 over; 990 B drained in 2 s: 495 B/s, 1.2 s
    assert err.value.headers["Retry-After"] == "2"


def test_byte_gate_release_stays_constant_time_at_high_request_rates():
    """Reproducer: every release past 4,096 in the window rescanned the whole window (72 % of the gateway's
    CPU at 2,000 req/s under wrk). Releases are kept in 0.1 s buckets: bounded memory, the same rate."""
    clock = Clock()
    gate = ByteGate(total_limit=10**9, key_limit=10**9, clock=clock, window_s=10.0)
    for _ in range(200_000):  # 20,000 req/s for 10 s, 1 KiB each
        r = Reservation(gate, "f")
        r.add(1024)
        r.close()
        clock.now += 1 / 20_000
    assert len(gate._released) <= 101  # noqa: SLF001 - the bound is the point
    assert gate.drain_rate() == pytest.approx(20_000 * 1024, rel=0.02)
    clock.now += 30.0
    assert gate.drain_rate() == 0.0 and gate._released_bytes == 0  # noqa: SLF001


def test_admission_by_time_refuses_what_would_miss_its_deadline():
    assert expected_wait_s(StageLoad(queued=10, servers=2, service_s=0.5)) == 2.5
    assert expected_wait_s(StageLoad(queued=10, servers=0, service_s=0.5)) == 0  # cold: not estimated
    assert admit_by_time([StageLoad(3, 1, 0.1), StageLoad(3, 1, 0.1)], deadline_s=1.0).admit
    verdict = admit_by_time([StageLoad(100, 2, 0.5), StageLoad(0, 1, 0.5)], deadline_s=5.0)
    assert not verdict.admit and verdict.expected_wait_s == pytest.approx(26.0)
    assert verdict.retry_after_s == 21 and verdict.error().status == 429
    assert verdict.error().headers["Retry-After"] == "21"


@pytest.fixture
def small(tmp_path):
    running = Running(tmp_path, max_body_bytes=1 << 20, max_inflight_bytes=400_000,
                      max_function_inflight_bytes=300_000)
    try:
        yield running
    finally:
        running.close()


def _slow_chunked(url: str, path: str, first: bytes) -> socket.socket:
    """Open a chunked POST and send its first chunk only: the gateway holds those bytes meanwhile."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                 + f"{len(first):x}\r\n".encode() + first + b"\r\n")
    return sock


def test_bodies_in_flight_are_bounded_by_bytes_chunked_ones_included(small):
    assert small.deploy(faas_cli_deploy_body("echo")).status_code == 202
    small.wait_available("echo", 1)
    over = requests.post(f"{small.url}/function/echo", data=b"x" * 300_001, timeout=10)
    assert over.status_code == 413 and over.json()["field"] == "body"  # one body over the function's bound
    sock = _slow_chunked(small.url, "/function/echo", b"a" * 250_000)
    try:
        deadline = time.monotonic() + 5
        while small.system.gateway.body_gate.total < 250_000 and time.monotonic() < deadline:
            time.sleep(0.01)  # the first chunk is counted as it arrives
        busy = requests.post(f"{small.url}/function/echo", data=b"y" * 100_000, timeout=10)
        assert busy.status_code == 429 and int(busy.headers["Retry-After"]) >= 1
        sock.sendall(b"5\r\nhello\r\n0\r\n\r\n")  # the chunked body completes: answered, bytes released
        reply = sock.recv(1 << 20)
        assert reply.startswith(b"HTTP/1.1 200")
    finally:
        sock.close()
    deadline = time.monotonic() + 5
    while small.system.gateway.body_gate.total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert small.system.gateway.body_gate.total == 0
    ok = requests.post(f"{small.url}/function/echo", data=b"y" * 100_000, timeout=10)
    assert ok.status_code == 200 and len(ok.content) == 100_000


def test_a_request_whose_expected_wait_exceeds_its_deadline_is_refused_at_entry(tmp_path):
    running = Running(tmp_path)
    try:
        body = faas_cli_deploy_body("slow", labels={"com.quart.concurrency": "1"})
        assert running.deploy(body).status_code == 202
        running.wait_available("slow", 1)
        fn = running.system.gateway.functions["slow"]

        async def load(admitted: int, service_s: float) -> None:
            fn.admitted = admitted
            fn.service.samples.clear()
            fn.service.samples.extend([service_s] * 10)

        running.call(load(20, 0.5))  # 20 ahead × 0.5 s on 1 replica + its own 0.5 s, × 1.5 (safety): 15.75 s
        res = requests.post(f"{running.url}/function/slow", data=b"x", headers={"X-Quart-Timeout-Ms": "2000"},
                            timeout=10)
        assert res.status_code == 429 and 13 <= int(res.headers["Retry-After"]) <= 15, res.text
        assert "deadline" in res.json()["error"]
        running.call(load(0, 0.5))
        res = requests.post(f"{running.url}/function/slow", data=b"x", headers={"X-Quart-Timeout-Ms": "2000"},
                            timeout=10)
        assert res.status_code == 200
    finally:
        running.close()


def test_gateway_config_refuses_a_function_bound_over_the_total(tmp_path):
    from quart_stage.settings import ConfigError

    with pytest.raises(ConfigError, match="max_function_inflight_bytes"):
        ThreadedSystem(tmp_path, max_inflight_bytes=10, max_function_inflight_bytes=20)


def test_router_entry_refuses_at_the_queue_cap_and_past_the_deadline_with_a_measured_retry_after():
    from collections import deque
    from types import SimpleNamespace

    from gateway_plugin.config import PluginConfig
    from gateway_plugin.entry import entry_admission
    from quart_kernel.admission import ServiceTimes

    services = {fn: ServiceTimes() for fn in ("m-0", "m-1")}
    for times in services.values():
        for _ in range(5):
            times.record(0.5)  # measured: 0.5 s per request (the estimator the proxy admits with too)
    queues = {"m-0": SimpleNamespace(jobs=deque(range(12)), busy=0), "m-1": SimpleNamespace(jobs=deque(), busy=0)}
    source = SimpleNamespace(concurrency=lambda fn: 1, ready=lambda fn: ["r1", "r2"])
    router = SimpleNamespace(clock=lambda: 6.0, queues=queues, source=source, service_times=services.__getitem__,
                             config=PluginConfig(queue_cap=10, retry_after_s=1, admission_safety=1.0))
    capped = entry_admission(router, "m", ["m-0", "m-1"], deadline_s=60.0)
    assert not capped.admit and "cap 10" in capped.reason and capped.retry_after_s == 1  # 3 × 0.5 s / 2
    queues["m-0"].jobs = deque(range(8))  # under the cap: 8 × 0.5 / 2 = 2 s + 1 s of service
    assert entry_admission(router, "m", ["m-0", "m-1"], deadline_s=60.0).admit
    late = entry_admission(router, "m", ["m-0", "m-1"], deadline_s=1.0)
    assert not late.admit and late.retry_after_s == 2 and "deadline" in late.reason


def test_a_client_deadline_bounds_the_wait_for_a_replica(tmp_path):
    running = Running(tmp_path)
    try:
        occupy = busy_function(running)
        occupy(1)  # its only replica is at its concurrency limit
        start = time.monotonic()
        res = requests.post(f"{running.url}/function/busy", data=b"x", headers={"X-Quart-Timeout-Ms": "300"},
                            timeout=10)
        assert res.status_code == 504 and res.json()["field"] == "X-Quart-Timeout-Ms"
        assert time.monotonic() - start < 2.0
        occupy(-1)
        assert requests.post(f"{running.url}/function/busy", data=b"x", timeout=10).status_code == 200
        assert running.system.gateway.body_gate.total == 0  # request and answer bytes released
    finally:
        running.close()


def test_large_bodies_and_answers_pass_whole_in_slices(gw):
    assert gw.deploy(faas_cli_deploy_body("echo")).status_code == 202
    gw.wait_available("echo", 1)
    body = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MB: read in place, answered in 1 MiB slices
    res = requests.post(f"{gw.url}/function/echo", data=body, timeout=30)
    assert res.status_code == 200 and res.content == body
    chunked = requests.post(f"{gw.url}/function/echo", data=iter([body[:1000], body[1000:]]), timeout=30)
    assert chunked.status_code == 200 and chunked.content == body
