"""A tiny llama partitioned and uploaded to a moto S3 registry: the live-start, part-start and ParaServe tests share it."""

from __future__ import annotations

import pytest
from quart_tools.partition import partition

from keysmanager.registry import ModelRegistry

URL = "s3://models/live/llama"



CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, _name="live-llama")



IDS = [[5, 17, 3, 99, 42, 7]]



@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """(moto endpoint, the partitioned model folder, its manifest), the model uploaded to URL."""
    from moto.server import ThreadedMotoServer

    root = tmp_path_factory.mktemp("live")
    creds = root / "aws-credentials"
    creds.write_text("[default]\naws_access_key_id = quart\naws_secret_access_key = quart-secret\n")
    creds.chmod(0o600)
    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        mp.delenv(var, raising=False)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    mp.setenv("QUART_REGISTRY_ENDPOINT", endpoint)  # the daemons inherit it
    model = root / "model"
    manifest = partition(CONFIG, 1, str(model), progress=False, seed=3, std=0.2)
    ModelRegistry(URL, endpoint_url=endpoint).upload(model)
    try:
        yield endpoint, model, manifest
    finally:
        server.stop()
        mp.undo()

