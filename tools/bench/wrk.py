"""Closed-loop HTTP load from ``wrk`` (Debian's package): keep-alive connections, a POST body, figures as JSON.

``wrk`` is a C client on epoll; on loopback one of its threads sends well over 100,000 small requests
per second, so the server under test, not the client, is what a run measures. A Lua script sets the
method and body and prints, when the run ends, one ``WRKJSON {...}`` line with the request count,
duration, errors and latency percentiles, parsed here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_SCRIPT = """\
wrk.method = "POST"
wrk.body = string.rep("q", {body_bytes})
wrk.headers["Content-Type"] = "application/octet-stream"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {{"requests": %d, "duration_us": %d, "errors": %d, "non_2xx": %d, '
    .. '"p50_us": %d, "p99_us": %d, "mean_us": %.1f}}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


@dataclass(frozen=True, slots=True)
class WrkResult:
    """One ``wrk`` run: completed requests per second and the latency percentiles it saw."""

    rps: float
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    mean_ms: float


def find_wrk(install: bool = False) -> str | None:
    """The path of ``wrk``; with ``install``, ``apt-get install -y wrk`` first when it is missing and we are root."""
    path = shutil.which("wrk")
    if path is None and install and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False, timeout=300)
        path = shutil.which("wrk")
    return path


def version(wrk: str) -> str:
    """``wrk``'s version line (it prints it with the usage text)."""
    res = subprocess.run([wrk, "--version"], capture_output=True, text=True, timeout=10)
    return (res.stdout or res.stderr).splitlines()[0].split(" Copyright")[0].strip()


def write_script(directory: Path, body_bytes: int) -> Path:
    path = directory / "post.lua"
    path.write_text(_SCRIPT.format(body_bytes=body_bytes))
    return path


def run_wrk(wrk: str, url: str, script: Path, connections: int, seconds: float, threads: int = 1) -> WrkResult:
    """``connections`` keep-alive connections on ``threads`` threads for ``seconds``; raises on any failed request."""
    duration = max(1, round(seconds))
    res = subprocess.run([wrk, "-t", str(threads), "-c", str(connections), "-d", f"{duration}s", "-s", str(script),
                          url], capture_output=True, text=True, timeout=duration + 60)
    lines = [line for line in res.stdout.splitlines() if line.startswith("WRKJSON ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"wrk against {url} failed ({res.returncode}): {res.stdout[-1000:]} {res.stderr[-1000:]}")
    data = json.loads(lines[-1].split(" ", 1)[1])
    if data["errors"] or data["non_2xx"]:
        raise RuntimeError(f"wrk against {url}: {data['errors']} socket errors, {data['non_2xx']} non-2xx answers")
    return WrkResult(rps=data["requests"] / (data["duration_us"] / 1e6), requests=data["requests"], errors=0,
                     p50_ms=data["p50_us"] / 1000, p99_ms=data["p99_us"] / 1000, mean_ms=data["mean_us"] / 1000)
