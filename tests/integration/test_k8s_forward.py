"""A stage pod's fork path (quart_stage.forward) against a real KeysManager, without Kubernetes.

``python -m quart_stage.forward`` started as a pod starts it (the shrinkwrapped template's folder, a pod's
environment with ``QUART_KEYSMANAGER_SOCKET``): the node's KeysManager forks a replica on a Unix socket and the
pod forwards to it. Checked: its answers equal a replica the KeysManager starts directly; it imports no torch;
SIGTERM stops the forked replica (the KeysManager's stop), SIGKILL too (the lease); a replica that ends makes it
exit; with no KeysManager it execs gunicorn (attach, then cold). The proxy's mechanics (streamed and chunked
bodies, keep-alive, 502, 504) against a werkzeug server on a Unix socket.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from quart_stage import wire
from quart_stage.config import StageConfig
from quart_stage.nodecache import stage_spec
from quart_stage.proxy import Upstream, serve
from quart_tools.bench.k8s_start import shrinkwrap
from support.keysmanager import Daemon, tiny_model_daemon
from werkzeug.serving import ThreadedWSGIServer
from werkzeug.wrappers import Request, Response

from keysmanager.client import KeysManagerError
from keysmanager.types import StageSpec

BODY = wire.encode_bytes({"input_ids": torch.tensor([[1, 2, 3, 4, 5]])})
HEADERS = {"Content-Type": wire.CONTENT_TYPE}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def node():
    """(model, KeysManager, shrinkwrapped build folder): the node a stage pod lands on."""
    with tiny_model_daemon("fwd") as (root, model, d):
        yield model, d, shrinkwrap(root / "build")


class Pod:
    """``python -m quart_stage.forward`` with a stage pod's environment, its log in a file."""

    def __init__(self, build: Path, model: Path, socket_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("QUART_", "PYTHONPATH"))}
        env.update({"QUART_MODEL_DIR": str(model), "QUART_STAGE_INDEX": "0", "QUART_NUM_STAGES": "2",
                    "QUART_COMPUTE": "cpu", "QUART_KEYSMANAGER_SOCKET": socket_path,
                    "QUART_BIND": f"127.0.0.1:{self.port}"})
        self.log = build.parent / f"pod-{self.port}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "quart_stage.forward"], cwd=build, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def ready(self, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(requests.ConnectionError):
                r = requests.get(self.url + "/_/health", timeout=10)
                if r.status_code == 200:
                    return r.json()
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.01)
        raise AssertionError(f"the pod did not become ready:\n{self.log.read_text()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def pod(build: Path, model: Path, socket_path: str):
    p = Pod(build, model, socket_path)
    try:
        yield p
    finally:
        p.close()


def replica(d: Daemon, rid: str):
    return next(r for r in d.client.replicas() if r.id == rid)


def wait_dead(d: Daemon, rid: str, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while (rep := replica(d, rid)).state != "dead" and time.monotonic() < deadline:
        time.sleep(0.05)
    return rep


def output(body: bytes) -> torch.Tensor:
    return wire.decode(body).tensors["hidden_states"]


def test_forwarded_answers_equal_a_direct_replica_and_sigterm_stops_it(node):
    model, d, build = node
    spec = StageSpec.from_dict(stage_spec(StageConfig(model_dir=str(model), stage_index=0, num_stages=2)))
    [direct] = d.client.start(spec)
    expected = requests.post(direct.url, data=BODY, headers=HEADERS, timeout=30)
    assert expected.status_code == 200
    d.client.stop(direct.id)
    with pod(build, model, str(d.socket)) as p:
        health = p.ready()
        assert health["start"] == "fork" and health["status"] == "ok"
        rep = replica(d, health["replica"])
        assert rep.state == "ready" and rep.source == "fork" and rep.socket and Path(rep.socket).exists()
        maps = Path(f"/proc/{p.proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "_C.cpython" not in maps, "the forwarder imports no torch"
        with requests.Session() as session:  # keep-alive: several answers over one client connection
            answers = [session.post(p.url, data=BODY, headers=HEADERS, timeout=30) for _ in range(3)]
            chunked = session.post(p.url + "/", data=iter([BODY[:100], BODY[100:]]), headers=HEADERS, timeout=30)
        for r in [*answers, chunked]:
            assert r.status_code == 200, r.text
            assert r.headers["X-Quart-Start"] == "fork"
            assert torch.equal(output(r.content), output(expected.content))
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(30) == 0
        dead = wait_dead(d, rep.id)
        assert dead.state == "dead" and dead.exit_status == 0, "the KeysManager's stop drained it"
        assert not Path(rep.socket).exists()
        assert "start path fork" in p.log.read_text()


def test_sigkill_of_the_pod_stops_the_replica_through_its_lease(node):
    model, d, build = node
    with pod(build, model, str(d.socket)) as p:
        rid = p.ready()["replica"]
        p.proc.kill()
        p.proc.wait(10)
        assert wait_dead(d, rid).state == "dead"


def test_a_replica_that_dies_ends_the_pod(node):
    model, d, build = node
    with pod(build, model, str(d.socket)) as p:
        rid = p.ready()["replica"]
        os.kill(replica(d, rid).pid, signal.SIGKILL)
        assert p.proc.wait(15) == 1, p.log.read_text()
        assert "ended or the KeysManager went away" in p.log.read_text()


def test_without_a_keysmanager_it_execs_gunicorn(node, tmp_path):
    model, _, build = node
    with pod(build, model, str(tmp_path / "missing.sock")) as p:
        health = p.ready()
        assert health["parameters"] == "memory" and "start" not in health  # attach failed too: the cold load
        log = p.log.read_text()
        assert "start path attach/cold" in log and "cannot reach the KeysManager" in log


def test_the_forwarder_imports_no_torch():
    code = "import sys, quart_stage.forward; print(sorted(m for m in ('torch', 'flask', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------- the proxy's mechanics
@Request.application
def _upstream_app(request: Request) -> Response:
    if request.path == "/slow":
        time.sleep(2)
    if request.path == "/stream":  # no Content-Length: the proxy re-chunks
        return Response(iter([b"a" * 70000, b"b" * 10]), direct_passthrough=True)
    return Response(request.get_data(), headers={"X-Path": request.path, "X-Len": str(len(request.get_data()))})


@pytest.fixture
def upstream(tmp_path):
    path = tmp_path / "up.sock"
    server = ThreadedWSGIServer(f"unix://{path}", 0, _upstream_app)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield str(path)
    server.shutdown()
    server.server_close()


def test_proxy_streams_bodies_both_ways(upstream):
    proxy = serve(("127.0.0.1", 0), Upstream(upstream, "r-1", timeout_s=1.0))
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    try:
        big = os.urandom(3 << 20)
        with requests.Session() as s:
            r = s.post(url + "/x?q=1", data=big, timeout=30)
            assert r.status_code == 200 and r.content == big and r.headers["X-Path"] == "/x"
            r = s.post(url, data=iter([big[:5], big[5:1000]]), timeout=30)  # a chunked request body
            assert r.content == big[:1000] and r.headers["X-Len"] == "1000"
            r = s.get(url + "/stream", timeout=30)
            assert r.content == b"a" * 70000 + b"b" * 10 and r.headers.get("Transfer-Encoding") == "chunked"
            r = s.post(url + "/slow", data=b"x", timeout=30)
            assert r.status_code == 504 and r.json()["field"] == "replica"
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_proxy_answers_502_when_the_replica_is_gone(tmp_path):
    proxy = serve(("127.0.0.1", 0), Upstream(str(tmp_path / "gone.sock"), "r-2"))
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    try:
        r = requests.post(url, data=b"abc", timeout=10)
        assert r.status_code == 502 and r.json()["field"] == "replica" and "r-2" in r.json()["error"]
        h = requests.get(url + "/_/health", timeout=10)
        assert h.status_code == 503 and h.json()["field"] == "replica"
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_keysmanager_refuses_a_bad_listen_and_an_unknown_lease(node):
    model, d, _ = node
    spec = stage_spec(StageConfig(model_dir=str(model), stage_index=0, num_stages=2))
    with pytest.raises(KeysManagerError) as bad:
        d.client._call("POST", "/v1/replicas", {"spec": spec, "listen": "udp"})
    assert bad.value.status == 400 and bad.value.field == "listen"
    with pytest.raises(KeysManagerError) as unknown:
        d.client._call("POST", "/v1/replicas/nope-1/lease", {})
    assert unknown.value.status == 404 and unknown.value.field == "replica_id"


def test_a_replica_never_leased_is_stopped(node):
    """A holder that dies between the start and the lease leaves nothing running (lease_within_s)."""
    model, d, _ = node
    spec = stage_spec(StageConfig(model_dir=str(model), stage_index=0, num_stages=2))
    body = {"spec": spec, "count": 1, "listen": "unix", "lease_within_s": 0.5}
    [orphan] = d.client._call("POST", "/v1/replicas", body)["replicas"]
    [held] = d.client._call("POST", "/v1/replicas", body)["replicas"]
    lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lease.connect(str(d.socket))
    lease.sendall(f"POST /v1/replicas/{held['id']}/lease HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    try:
        assert wait_dead(d, orphan["id"]).state == "dead"
        assert replica(d, held["id"]).state == "ready", "a leased replica keeps running"
    finally:
        lease.close()
    assert wait_dead(d, held["id"]).state == "dead"
    with pytest.raises(KeysManagerError) as bad:
        d.client._call("POST", "/v1/replicas", {**body, "lease_within_s": 0})
    assert bad.value.status == 400 and bad.value.field == "lease_within_s"
