"""A stage started from its node's parameter cache (quart_stage.attach) against a real KeysManager.

The same path a stage pod takes on Kubernetes, without Kubernetes: the shrinkwrapped template
(``gunicorn index:app``) with ``QUART_KEYSMANAGER_SOCKET`` set asks the KeysManager to cache the stage and
maps its segment. Checked: outputs equal a replica loaded from the folder; the segment's pages are mapped,
not copied (tensor data inside the mapping, no anonymous pages in it), and never written; the fallback to
the folder when the socket is missing, the KeysManager refuses, or the segment does not match its index.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import socketserver
import threading
from pathlib import Path

import pytest
import requests
import torch
from quart_stage import wire
from quart_stage.attach import load_stage, stage_spec
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_stage.serve import GunicornServer
from quart_tools.bench.k8s_start import shrinkwrap
from support.keysmanager import Daemon, daemons_in_temp_dir, tiny_model_daemon
from support.paths import REPO

from keysmanager.types import StageSpec

ROOT = REPO
TEMPLATE = ROOT / "template" / "pipeline-stage"
BODY = wire.encode_bytes({"input_ids": torch.tensor([[1, 2, 3, 4, 5]])})
HEADERS = {"Content-Type": wire.CONTENT_TYPE}


@pytest.fixture(scope="module")
def km():
    """(model folder, running KeysManager, temp root): cleaned up with every process and segment."""
    with tiny_model_daemon("att") as (root, model, d):
        yield model, d, root


def cfg(model: Path, socket: str | None, stage: int = 0) -> StageConfig:
    return StageConfig(model_dir=str(model), stage_index=stage, keysmanager_socket=socket)


def output(body: bytes) -> torch.Tensor:
    return wire.decode(body).tensors["hidden_states"]


def segment_mapping(path: str) -> tuple[int, int, dict[str, int]]:
    """(start, end, summed smaps kB fields) of this process's mapping of ``path``."""
    start = end = 0
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                inside = head[-1] == path
                if inside:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    start, end = start or lo, max(end, hi)
            elif inside and line.rstrip().endswith("kB"):
                fields[head[0].rstrip(":")] = fields.get(head[0].rstrip(":"), 0) + int(head[1])
    return start, end, fields


def test_attached_stage_equals_the_folder_and_shares_the_segment(km):
    model, d, _ = km
    attached = load_stage(cfg(model, str(d.socket)))
    loaded = StageRuntime.load(cfg(model, None))
    assert attached.parameter_source == "node-cache" and loaded.parameter_source == "memory"
    answer = attached.handle(BODY, HEADERS)
    assert answer.status == 200 and torch.equal(output(answer.body), output(loaded.handle(BODY, HEADERS).body))
    [zygote] = [z for z in d.client.zygotes() if z.function == stage_spec(cfg(model, None))["function"]]
    start, end, smaps = segment_mapping(zygote.shm_path)
    assert end > start, "the segment is mapped"
    params = list(attached.module.parameters())
    assert params and all(start <= t.data_ptr() < end for t in params if t.numel()), "tensors view the mapping"
    assert smaps["Rss"] > 0 and smaps["Anonymous"] == 0, "pages read through, none copied"


def test_a_write_never_reaches_the_segment(km):
    model, d, _ = km
    runtime = load_stage(cfg(model, str(d.socket)))
    z = next(z for z in d.client.zygotes() if z.function == stage_spec(cfg(model, None))["function"])
    before = Path(z.shm_path).read_bytes()
    with torch.no_grad():
        for t in runtime.module.parameters():
            t.add_(1)  # copy-on-write: private pages of this process
    assert Path(z.shm_path).read_bytes() == before
    assert oct(os.stat(z.shm_path).st_mode & 0o777) == "0o600"


def test_pod_start_path_serves_from_the_node_cache(km, tmp_path):
    """The template as faas-cli shrinkwraps it, under gunicorn with a pod's environment."""
    model, d, _ = km
    build = shrinkwrap(tmp_path / "build")
    env = {"QUART_MODEL_DIR": str(model), "QUART_STAGE_INDEX": "0", "QUART_NUM_STAGES": "2", "QUART_COMPUTE": "cpu",
           "PYTHONPATH": ""}
    pod_env = {**env, "QUART_KEYSMANAGER_SOCKET": str(d.socket)}
    with GunicornServer(pod_env, app="index:app", cwd=str(build), extra_args=["--config", "gunicorn.conf.py"]) as server:
        assert requests.get(server.url + "/_/health", timeout=10).json()["parameters"] == "node-cache"
        r = requests.post(server.url, data=BODY, headers=HEADERS, timeout=30)
        assert r.status_code == 200, r.text
    reference = StageRuntime.load(cfg(model, None)).handle(BODY, HEADERS)
    assert torch.equal(output(r.content), output(reference.body))


class _Answer(http.server.BaseHTTPRequestHandler):
    """A fake KeysManager: answers every POST with the server's ``status`` and ``body``."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        raw = json.dumps(self.server.body).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def fake_keysmanager(path: Path, status: int, body: dict):
    server = socketserver.UnixStreamServer(str(path), _Answer)
    server.status, server.body = status, body
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield str(path)
    finally:
        server.shutdown()
        server.server_close()
        path.unlink(missing_ok=True)


def test_falls_back_to_the_folder_when_the_cache_fails(km, caplog):
    model, d, root = km
    reference = StageRuntime.load(cfg(model, None)).handle(BODY, HEADERS)
    assert reference.status == 200
    full = d.client.attach(StageSpec.from_dict(stage_spec(cfg(model, None))))
    bad_index = {**full, "segment": {**full["segment"], "total_bytes": full["segment"]["total_bytes"] + 64}}
    other = {**full, "sha256": "0" * 64}
    with contextlib.ExitStack() as stack:
        refused = stack.enter_context(fake_keysmanager(root / "refuse.sock", 507, {"error": "no room", "field": "spec"}))
        wrong_size = stack.enter_context(fake_keysmanager(root / "size.sock", 200, bad_index))
        other_ckpt = stack.enter_context(fake_keysmanager(root / "other.sock", 200, other))
        cases = {str(root / "missing.sock"): "cannot reach the KeysManager", refused: "answered 507: no room",
                 wrong_size: "its index says", other_ckpt: "another checkpoint"}
        for socket, why in cases.items():
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="quart_stage.attach"):
                runtime = load_stage(cfg(model, socket))
            assert runtime.parameter_source == "memory", socket
            assert why in caplog.text and "loading from" in caplog.text, caplog.text
            assert torch.equal(output(runtime.handle(BODY, HEADERS).body), output(reference.body))


def test_real_keysmanager_error_falls_back(km, tmp_path, caplog):
    """A KeysManager that cannot cache the stage (memory limit of 1 byte) answers 507: the stage loads its folder."""
    model, _, root = km
    with daemons_in_temp_dir() as (small_root, daemons, _):
        tight = Daemon(small_root, "tight", "--memory-limit", "1")
        daemons.append(tight)
        tight.start()
        with caplog.at_level(logging.WARNING, logger="quart_stage.attach"):
            runtime = load_stage(cfg(model, str(tight.socket)))
        assert runtime.parameter_source == "memory" and "answered 507" in caplog.text
        assert not tight.client.zygotes()


def test_registry_only_stage_without_a_cache_says_what_it_needs(tmp_path):
    missing = StageConfig(model_url="s3://bucket/tiny", keysmanager_socket=str(tmp_path / "none.sock"))
    with pytest.raises(ValueError, match="QUART_MODEL_DIR"):
        load_stage(missing)
