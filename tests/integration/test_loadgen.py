"""Load generator: open loop (sends keep schedule against a slow server), records, errors."""

from __future__ import annotations

import math

import numpy as np
from quart_tools.arrivals import Arrivals, poisson_arrivals
from quart_tools.bench.loadgen import trivial_server
from quart_tools.loadgen import generate_load, parse_stage_headers, read_records, write_records


def test_open_loop_sends_are_not_delayed_by_a_slow_server() -> None:
    # 300 req/s for 2 s against a server that answers after 1 s: a closed-loop client with any
    # reasonable concurrency would stall; the open-loop one must send on schedule.
    arrivals = poisson_arrivals(300.0, 2.0, seed=5)
    with trivial_server(delay_ms=1000.0) as url:
        result = generate_load(url, arrivals, timeout_s=5.0)
    assert len(result.records) == len(arrivals)
    assert all(r.status == 200 for r in result.records)
    err = result.send_error_ms()
    assert np.percentile(err, 95) < 20.0, np.percentile(err, [50, 95, 99])
    lat = np.array([r.latency_ms for r in result.records])
    assert lat.min() >= 990.0  # every response took the server's second
    # Sends overlapped: at the last send, earlier requests were still waiting for their answers.
    # (the old form, last send < 1 s + the first answer, sat on its own boundary: a 2 s schedule against 1 s answers)
    last_sent = max(r.sent_s for r in result.records)
    waiting = [r for r in result.records if r.sent_s < last_sent < r.sent_s + r.latency_ms / 1000]
    assert len(waiting) >= 100, len(waiting)  # ~1 s of a 300 req/s schedule was still unanswered
    assert result.records[0].stages == {"stage-0-compute": 0.5}


def test_every_request_ends_with_status_or_error(tmp_path) -> None:
    arrivals = Arrivals(times=np.array([0.0, 0.01, 0.02]), sizes=np.array([10, 10, 10]))
    with trivial_server(delay_ms=3000.0) as url:
        result = generate_load(url, arrivals, timeout_s=0.3)
    assert len(result.records) == 3
    assert all(r.status == 0 and r.error and "timeout" in r.error for r in result.records)
    assert all(math.isnan(r.latency_ms) for r in result.records)
    # Nobody listens on this port once the server is gone: a client error, not a hang.
    result = generate_load(url, arrivals, timeout_s=2.0)
    assert all(r.status == 0 and r.error and r.error.startswith("client error") for r in result.records)
    path = tmp_path / "rec.jsonl"
    write_records(result.records, path)
    back = read_records(path)
    assert [r.error for r in back] == [r.error for r in result.records]
    assert all(math.isnan(r.latency_ms) for r in back)


def test_run_bound_cancels_and_records() -> None:
    arrivals = Arrivals(times=np.array([0.0, 0.05, 5.0]), sizes=np.array([1, 1, 1]))
    with trivial_server(delay_ms=2000.0) as url:
        result = generate_load(url, arrivals, timeout_s=10.0, max_run_s=0.5)
    assert len(result.records) == 3
    assert "cancelled" in result.records[0].error
    assert "not sent" in result.records[2].error


def test_parse_stage_headers() -> None:
    got = parse_stage_headers({"X-Quart-Stage-3-Wait-Ms": "1.5", "X-Quart-Compute-Ms": "2",
                               "X-Quart-Model": "bert", "X-Quart-Bad-Ms": "n/a", "Content-Length": "3"})
    assert got == {"stage-3-wait": 1.5, "compute": 2.0}


def test_cli_writes_records(tmp_path, capsys) -> None:
    import json

    from quart_tools.loadgen import main

    out = tmp_path / "rec.jsonl"
    with trivial_server() as url:
        assert main([url, "--arrivals", "gamma", "--rate", "100", "--cv", "2", "--duration", "1", "--body",
                     "input-ids", "--header", "X-Test: 1", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = read_records(out)
    assert summary["requests"] == len(records) > 50 and summary["ok"] == len(records)
    assert main([url, "--header", "no-colon", "--out", str(out)]) == 2


def test_cli_exits_1_when_requests_fail_unless_allowed(tmp_path, capsys) -> None:
    """Some answers are 503: the run says how many failed and exits 1; --max-failed 1 accepts any failure."""
    import itertools
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from quart_tools.loadgen import main

    counter = itertools.count()

    class Flaky(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status = 503 if next(counter) % 3 == 0 else 200
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        out = str(tmp_path / "rec.jsonl")
        assert main([url, "--rate", "60", "--duration", "0.5", "--out", out]) == 1
        captured = capsys.readouterr()
        summary = json.loads(captured.out.strip().splitlines()[-1])
        assert summary["failed"]["503"] > 0 and "requests failed" in captured.err and "503" in captured.err
        assert main([url, "--rate", "60", "--duration", "0.5", "--out", out, "--max-failed", "1"]) == 0
    finally:
        server.shutdown()
        server.server_close()
