"""Issue 14: an admitted call finishes within its deadline, or is refused at entry.

Reproducers (`quartctl bench chaos`): calls sent with ``X-Quart-Timeout-Ms: 3.5`` were admitted and answered
504 (a deadline no replica can meet); at 8× capacity with 32 MB bodies, accepted calls took 2.5 s against a
2 s deadline (admission ignored the body's transfer and planned with a mean service time, no margin).
"""

from __future__ import annotations

import socket

import pytest
import requests
from quart_kernel.admission import RateMeter, ServiceTimes, StageLoad, admit_by_time, expected_wait_s
from support.faas_cli import running_echo


def test_service_times_give_the_p90_and_the_fastest():
    times = ServiceTimes()
    assert times.p90() == 0.0 and times.fastest() == 0.0
    for ms in range(1, 101):
        times.record(ms / 1000)
    times.record(float("nan"))  # ignored
    assert times.p90() == pytest.approx(0.094) and times.fastest() == pytest.approx(0.037)  # the last 64 kept


def test_rate_meter_ignores_small_bodies_and_estimates_transfers():
    meter = RateMeter(min_bytes=1000)
    meter.record(10, 1.0)
    assert meter.seconds(1_000_000) == 0.0  # nothing measured yet
    meter.record(1_000_000, 0.5)
    assert meter.seconds(1_000_000) == pytest.approx(0.5) and meter.seconds(None) == 0.0


def test_a_deadline_below_the_fastest_call_or_the_floor_is_a_400_naming_the_header():
    fast = StageLoad(0, 1, service_s=0.010, fastest_s=0.007)
    verdict = admit_by_time([fast], deadline_s=0.0035, what="a call of 'f'")
    assert not verdict.admit and verdict.status == 400
    err = verdict.error()
    assert err.status == 400 and err.field == "X-Quart-Timeout-Ms" and "3.5 ms" in err.message
    unmeasured = admit_by_time([StageLoad(0, 1, 0.0)], deadline_s=0.0035, floor_s=0.005)
    assert unmeasured.status == 400  # nothing measured yet: the floor decides
    assert admit_by_time([StageLoad(0, 1, 0.0)], deadline_s=0.006, floor_s=0.005).admit
    pipeline = [StageLoad(0, 1, 0.006, fastest_s=0.005)] * 3  # three stages: 15 ms at the fastest
    assert admit_by_time(pipeline, deadline_s=0.012).status == 400


def test_the_body_transfer_the_busy_servers_and_the_safety_factor_count():
    assert expected_wait_s(StageLoad(0, 1, 0.5, busy=True)) == 0.5  # the one replica is serving
    assert expected_wait_s(StageLoad(0, 1, 0.5)) == 0.0
    load = StageLoad(0, 1, 0.5, fastest_s=0.3)
    assert admit_by_time([load], deadline_s=2.0, transfer_s=1.0).admit  # 1.5 s
    verdict = admit_by_time([load], deadline_s=2.0, transfer_s=1.0, safety=1.5)  # 2.25 s
    assert not verdict.admit and verdict.status == 429 and verdict.retry_after_s == 1
    assert verdict.expected_wait_s == pytest.approx(2.25)
    busy = admit_by_time([StageLoad(2, 1, 0.5, busy=True)], deadline_s=2.0, safety=1.5)  # (3 + 1) × 0.5 × 1.5
    assert not busy.admit and busy.retry_after_s == 1 and busy.error().headers["Retry-After"] == "1"


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    yield from running_echo(tmp_path_factory.mktemp("deadline"))


def test_a_too_short_deadline_gets_a_400_not_a_504(echo):
    res = requests.post(f"{echo.url}/function/echo", data=b"x", headers={"X-Quart-Timeout-Ms": "3.5"}, timeout=10)
    assert res.status_code == 400 and res.json()["field"] == "X-Quart-Timeout-Ms", res.text
    for _ in range(3):  # measured now: a deadline under the fastest call is refused the same way
        assert requests.post(f"{echo.url}/function/echo", data=b"x", timeout=10).status_code == 200
    fastest_ms = 1000 * echo.system.gateway.functions["echo"].service.fastest()
    res = requests.post(f"{echo.url}/function/echo", data=b"x", timeout=10,
                        headers={"X-Quart-Timeout-Ms": f"{max(5.0, fastest_ms) * 0.99:.3f}"})
    assert res.status_code == 400, res.text
    assert requests.post(f"{echo.url}/function/echo", data=b"x", headers={"X-Quart-Timeout-Ms": "5000"},
                         timeout=10).status_code == 200


def _expect(url: str, deadline_ms: str) -> bytes:
    """Headers only, with ``Expect: 100-continue``: the gateway's first answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /function/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n"
                     f"X-Quart-Timeout-Ms: {deadline_ms}\r\n\r\n".encode())
        first = sock.recv(4096)
        if first.startswith(b"HTTP/1.1 100"):
            sock.sendall(b"z" * 1000)
            first += sock.recv(4096)
        return first


def test_expect_100_continue_refuses_before_the_body_is_sent(echo):
    refused = _expect(echo.url, "1")
    assert refused.startswith(b"HTTP/1.1 400") and b"X-Quart-Timeout-Ms" in refused
    accepted = _expect(echo.url, "5000")
    assert accepted.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 200" in accepted
