"""Stages over HTTP through gunicorn: equivalence with the whole model, strict 4xx on bad input."""

from __future__ import annotations

import json
import socket
import struct

import pytest
import requests
import torch
from quart_stage import wire
from quart_stage.manifest import Manifest
from quart_stage.serve import MOUNTS_APP, GunicornServer
from quart_stage.verify import reference_model, reference_output
from quart_tools.partition import partition

FAMILIES = {"decoder": "tiny", "encoder": "tiny-encoder"}
STAGE_COUNTS = (1, 2, 3, 4, 8)
MAX_BODY = 4 << 20
OCTET = {"Content-Type": wire.CONTENT_TYPE}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every stage of every (family, N) partition, mounted under /<family>/<n>/<i> in one gunicorn."""
    root = tmp_path_factory.mktemp("http")
    mounts, dirs = {}, {}
    for family, preset in FAMILIES.items():
        for n in STAGE_COUNTS:
            d = str(root / f"{family}-{n}")
            partition(preset, n, d, progress=False, seed=3)
            dirs[family, n] = d
            for i in range(n):
                mounts[f"/{family}/{n}/{i}"] = {"QUART_MODEL_DIR": d, "QUART_STAGE_INDEX": i, "QUART_NUM_STAGES": n}
    env = {"QUART_STAGE_MOUNTS": json.dumps(mounts), "QUART_MAX_BODY_BYTES": str(MAX_BODY)}
    with GunicornServer(env, app=MOUNTS_APP) as server:
        yield server, dirs


def _post(url: str, body: bytes, headers: dict | None = None) -> requests.Response:
    return requests.post(url, data=body, headers={**OCTET, **(headers or {})}, timeout=30)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_http_chain_matches_whole_model(served, family):
    server, dirs = served
    reference = reference_model(dirs[family, 1])  # same seed: identical weights for every N
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = reference_output(reference, ids)
    for n in STAGE_COUNTS:
        body = wire.encode_bytes({"input_ids": ids})
        for i in range(n):
            r = _post(f"{server.url}/{family}/{n}/{i}/", body, {"X-Quart-Request-Id": f"req-{n}", "X-Quart-Stage": str(i)})
            assert r.status_code == 200, r.text
            assert r.headers["X-Quart-Request-Id"] == f"req-{n}"
            assert r.headers["X-Quart-Compute-Mode"] == "cpu"
            for h in ("X-Quart-Deserialize-Ms", "X-Quart-Compute-Ms", "X-Quart-Serialize-Ms"):
                assert float(r.headers[h]) >= 0.0
            body = r.content
        decoded = wire.decode(body)
        assert decoded.metadata["model"] == Manifest.load(dirs[family, n]).model
        got = decoded.tensors["logits"]
        assert (got - expected).abs().max().item() <= 1e-5, f"{family} N={n}"


def test_json_input_and_json_output(served):
    server, _ = served
    ids = [[5, 6, 7, 8]]
    r = requests.post(f"{server.url}/decoder/1/0/", json={"input_ids": ids}, headers={"Accept": "application/json"},
                      timeout=30)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["output"] == "logits" and doc["shape"] == [1, 4, 512] and len(doc["argmax"][0]) == 4
    r2 = requests.post(f"{server.url}/decoder/1/0/", json={"text": "hi there"}, timeout=30)
    assert r2.status_code == 200, r2.text
    assert wire.decode(r2.content).tensors["logits"].shape == (1, 8, 512)  # byte-level tokenizer: 8 bytes


def _hidden(n: int = 1, seq: int = 4, width: int = 64, dtype=torch.float32) -> bytes:
    return wire.encode_bytes({"hidden_states": torch.zeros(n, seq, width, dtype=dtype)})


BAD_REQUESTS = [
    # (name, path, body, headers, status, field)
    ("truncated", "/decoder/2/1/", _hidden()[:-10], {}, 400, "body"),
    ("truncated header", "/decoder/2/1/", _hidden()[:20], {}, 400, "body"),
    ("wrong dtype", "/decoder/2/1/", _hidden(dtype=torch.float16), {}, 400, "hidden_states"),
    ("wrong shape", "/decoder/2/1/", _hidden(width=63), {}, 400, "hidden_states"),
    ("wrong rank", "/decoder/2/1/", wire.encode_bytes({"hidden_states": torch.zeros(4, 64)}), {}, 400, "hidden_states"),
    ("json where bytes expected", "/decoder/2/1/", b'{"input_ids": [[1, 2]]}', {"Content-Type": "application/json"},
     415, "content-type"),
    ("json bytes as octet-stream", "/decoder/2/1/", b'{"input_ids": [[1, 2]]}', {}, 400, "body"),
    ("wrong model", "/decoder/2/1/", _hidden(), {"X-Quart-Model": "other"}, 400, "model"),
    ("wrong stage", "/decoder/2/1/", _hidden(), {"X-Quart-Stage": "0"}, 400, "stage"),
    ("ids out of vocab", "/decoder/2/0/", wire.encode_bytes({"input_ids": torch.tensor([[1, 999]])}), {}, 400,
     "input_ids"),
    ("float ids", "/decoder/2/0/", wire.encode_bytes({"input_ids": torch.zeros(1, 3)}), {}, 400, "input_ids"),
    ("bad json", "/decoder/2/0/", b'{"input_ids": [[1, 2]', {"Content-Type": "application/json"}, 400, "body"),
    ("ragged json", "/decoder/2/0/", b'{"input_ids": [[1, 2], [3]]}', {"Content-Type": "application/json"}, 400,
     "input_ids"),
    ("unknown tensor", "/decoder/2/1/", wire.encode_bytes({"hidden_states": torch.zeros(1, 2, 64), "x": torch.zeros(1)}),
     {}, 400, "x"),
    ("sequence too long", "/encoder/2/0/", wire.encode_bytes({"input_ids": torch.zeros(1, 300, dtype=torch.long)}), {},
     400, "input_ids"),
]


def _lying_header() -> bytes:
    header = json.dumps({"hidden_states": {"dtype": "F32", "shape": [1, 4, 64], "data_offsets": [0, 16]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 16


BAD_REQUESTS.append(("header lies", "/decoder/2/1/", _lying_header(), {}, 400, "hidden_states"))


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_is_4xx_and_worker_keeps_serving(served, case):
    server, _ = served
    _, path, body, headers, status, field = case
    r = _post(server.url + path, body, headers)
    assert r.status_code == status, r.text
    for h in ("X-Quart-Deserialize-Ms", "X-Quart-Compute-Ms", "X-Quart-Serialize-Ms", "X-Quart-Compute-Mode"):
        assert h in r.headers  # timing headers on every response, errors included
    doc = r.json()
    assert doc["field"] == field and doc["error"]
    good = _post(f"{server.url}/decoder/2/1/", _hidden())
    assert good.status_code == 200


def test_body_announcing_one_gigabyte_is_refused_before_reading(served):
    server, _ = served
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /decoder/2/1/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                  b"Content-Length: 1073741824\r\n\r\n" + b"\0" * 1024)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"X-Quart-Compute-Ms: 0.000" in head
    assert json.loads(payload)["field"] == "body"
    assert _post(f"{server.url}/decoder/2/1/", _hidden()).status_code == 200


def test_body_over_limit_without_content_length_is_413(served):
    server, _ = served

    def chunks():
        for _ in range(5):
            yield b"\0" * (1 << 20)

    r = requests.post(f"{server.url}/decoder/2/1/", data=chunks(), headers=OCTET, timeout=30)
    assert r.status_code == 413 and r.json()["field"] == "body"
    assert _post(f"{server.url}/decoder/2/1/", _hidden()).status_code == 200
