"""A tiny llama partitioned and uploaded to a moto S3 registry: the live-start, part-start and ParaServe tests share it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from quart_tools.partition import partition

from keysmanager.registry import ModelRegistry

URL = "s3://models/live/llama"



CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, _name="live-llama")



IDS = [[5, 17, 3, 99, 42, 7]]



@contextlib.contextmanager
def moto_s3(root: Path) -> Iterator[str]:
    """A moto S3 server on an ephemeral port with a 0600 credentials file in ``root``; ``QUART_REGISTRY_ENDPOINT``
    and the credentials are in the environment (the daemons inherit them) until it stops. Yields the endpoint."""
    from moto.server import ThreadedMotoServer

    creds = root / "aws-credentials"
    creds.write_text("[default]\naws_access_key_id = quart\naws_secret_access_key = quart-secret\n")
    creds.chmod(0o600)
    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        mp.delenv(var, raising=False)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        mp.setenv("QUART_REGISTRY_ENDPOINT", endpoint)
        yield endpoint
    finally:
        server.stop()
        mp.undo()


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """(moto endpoint, the partitioned model folder, its manifest), the model uploaded to URL."""
    root = tmp_path_factory.mktemp("live")
    with moto_s3(root) as endpoint:
        model = root / "model"
        manifest = partition(CONFIG, 1, str(model), progress=False, seed=3, std=0.2)
        ModelRegistry(URL, endpoint_url=endpoint).upload(model)
        yield endpoint, model, manifest


_RUNTIMES: dict[str, object] = {}  # model folder → its stage 0 loaded the ordinary way (once per session)


def reference_answer(registry, body: bytes, layers: str) -> bytes:
    """What the registry model's whole stage 0, loaded the ordinary way, answers for ``layers`` (the wire body;
    ``0-…`` takes JSON ids, a later range the wire activations)."""
    from quart_stage import wire
    from quart_stage.config import StageConfig
    from quart_stage.runtime import StageRuntime

    _, model, _ = registry
    rt = _RUNTIMES.get(str(model)) or _RUNTIMES.setdefault(
        str(model), StageRuntime.load(StageConfig(model_dir=str(model), stage_index=0)))
    ctype = "application/json" if layers.startswith("0-") else wire.CONTENT_TYPE
    resp = rt.handle(body, {"Content-Type": ctype, "X-Quart-Layers": layers})
    assert resp.status == 200, resp.body
    return resp.body
