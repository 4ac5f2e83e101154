"""The model registry against a real S3-compatible server (moto's, on an ephemeral port): upload, streamed
verified fetch, a local model folder a stage loads, and clear errors for every way it can go wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.paths import REPO

from keysmanager.registry import MANIFEST, ModelRegistry, RegistryError, parse_model_url, s3_client

ROOT = REPO


@pytest.fixture(scope="module")
def endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def credentials(monkeypatch, tmp_path):
    creds = tmp_path / "aws-credentials"
    creds.write_text("[default]\naws_access_key_id = quart\naws_secret_access_key = quart-secret\n")
    creds.chmod(0o600)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, endpoint) -> Path:
    """The tiny model partitioned and uploaded by `quartctl partition --upload` (as a user would)."""
    out = tmp_path_factory.mktemp("tiny")
    creds = out.parent / "cli-credentials"
    creds.write_text("[default]\naws_access_key_id = quart\naws_secret_access_key = quart-secret\n")
    creds.chmod(0o600)
    env = {**os.environ, "QUART_REGISTRY_ENDPOINT": endpoint, "AWS_SHARED_CREDENTIALS_FILE": str(creds)}
    done = subprocess.run([sys.executable, "-m", "quart_tools.cli", "partition", "--model", "tiny", "--stages", "2",
                           "--out", str(out), "--upload", "s3://models/cli/tiny"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "uploaded 5 objects to s3://models/cli/tiny" in done.stdout
    return out


def test_partition_upload_writes_the_model_url_into_stack_yml(tiny, endpoint) -> None:
    import yaml

    stack = yaml.safe_load((tiny / "stack.yml").read_text())
    envs = [fn["environment"] for fn in stack["functions"].values()]
    assert all(e["QUART_MODEL_URL"] == "s3://models/cli/tiny" and "QUART_MODEL_DIR" not in e for e in envs)
    assert ModelRegistry("s3://models/cli/tiny", endpoint_url=endpoint).manifest()["model"] == "tiny"


def test_model_url_is_checked() -> None:
    assert parse_model_url("s3://models/llm/tiny/") == ("models", "llm/tiny")
    for bad in ("http://x/y", "s3:///nobucket", "models/tiny"):
        with pytest.raises(RegistryError, match="s3://bucket"):
            parse_model_url(bad)


def test_upload_then_materialize_a_stage_that_loads_and_computes_the_same(endpoint, tiny, tmp_path) -> None:
    registry = ModelRegistry("s3://models/tiny", endpoint_url=endpoint)
    keys = registry.upload(tiny)
    assert keys[-1] == "tiny/manifest.json"  # the manifest last
    seen: list[tuple[int, int]] = []
    local = tmp_path / "host-cache"
    result = registry.materialize(0, local, on_progress=lambda done, total: seen.append((done, total)))
    manifest = json.loads((tiny / MANIFEST).read_text())
    entry = manifest["stages"][0]
    assert result.nbytes == entry["file_bytes"] and seen[-1] == (entry["file_bytes"], entry["file_bytes"])
    assert (local / entry["file"]).read_bytes() == (tiny / entry["file"]).read_bytes()
    assert not (local / manifest["stages"][1]["file"]).exists()  # only the stage asked for
    assert not list(local.glob("*.partial"))

    import torch
    from quart_stage import wire
    from quart_stage.config import StageConfig
    from quart_stage.runtime import StageRuntime

    bodies = []
    for folder in (tiny, local):
        runtime = StageRuntime.load(StageConfig.from_env({"QUART_MODEL_DIR": str(folder), "QUART_STAGE_INDEX": "0"}))
        reply = runtime.handle(b'{"input_ids": [[1, 2, 3, 4]]}', {"Content-Type": "application/json"})
        assert reply.status == 200
        bodies.append(wire.decode(reply.body).tensors)
    assert bodies[0].keys() == bodies[1].keys()
    assert all(torch.equal(bodies[0][k], bodies[1][k]) for k in bodies[0])


def test_a_corrupt_object_is_never_cached(endpoint, tiny, tmp_path) -> None:
    registry = ModelRegistry("s3://models/corrupt", endpoint_url=endpoint)
    registry.upload(tiny)
    manifest = json.loads((tiny / MANIFEST).read_text())
    name = manifest["stages"][1]["file"]
    data = bytearray((tiny / name).read_bytes())
    data[-1] ^= 0xFF
    s3_client(endpoint).put_object(Bucket="models", Key=f"corrupt/{name}", Body=bytes(data))
    with pytest.raises(RegistryError, match="checksum mismatch"):
        registry.materialize(1, tmp_path / "c")
    assert not (tmp_path / "c" / name).exists() and not list((tmp_path / "c").glob("*.partial"))
    assert not (tmp_path / "c" / MANIFEST).exists()


def test_clear_errors(endpoint, tiny, tmp_path) -> None:
    with pytest.raises(RegistryError, match="no such object"):
        ModelRegistry("s3://models/never-uploaded", endpoint_url=endpoint).manifest()
    with pytest.raises(RegistryError, match="bucket 'nosuchbucket' does not exist"):
        ModelRegistry("s3://nosuchbucket/x", endpoint_url=endpoint).manifest()
    with pytest.raises(RegistryError, match="unreachable"):
        ModelRegistry("s3://models/tiny", endpoint_url="http://127.0.0.1:9").manifest()
    registry = ModelRegistry("s3://models/tiny2", endpoint_url=endpoint)
    registry.upload(tiny)
    with pytest.raises(RegistryError, match="stages 0..1, not 5"):
        registry.materialize(5, tmp_path / "x")
    half = tmp_path / "half"
    shutil.copytree(tiny, half)
    (half / MANIFEST).unlink()
    with pytest.raises(RegistryError, match="partition the model first"):
        ModelRegistry("s3://models/half", endpoint_url=endpoint).upload(half)


def test_a_keysmanager_starts_a_stage_from_the_registry_and_forks_it_after(endpoint, tiny, monkeypatch) -> None:
    """The host agent fetches the stage on its first start (cold), caches a zygote, forks the next one; the
    replicas answer as replicas of the local folder do. A missing model is a 502 naming the cause."""
    from support.keysmanager import Daemon, daemons_in_temp_dir, infer, stage

    from keysmanager.client import KeysManagerError
    from keysmanager.types import StageSpec

    monkeypatch.setenv("QUART_REGISTRY_ENDPOINT", endpoint)  # the host agent's registry settings
    remote = StageSpec("tiny-stage-0", env={"QUART_MODEL_URL": "s3://models/cli/tiny", "QUART_STAGE_INDEX": "0",
                                            "QUART_COMPUTE": "cpu"})
    with daemons_in_temp_dir() as (root, daemons, _):
        d = Daemon(root, "reg")
        daemons.append(d)
        d.start()
        first = d.client.start(remote)[0]
        assert first.source == "cold"
        fetched = list((d.state_dir / "registry").glob("*-0/stage-0.safetensors"))
        assert len(fetched) == 1 and not list((d.state_dir / "registry").rglob("*.partial"))
        second = d.client.start(remote)[0]
        assert second.source == "fork"
        local = d.client.start(stage(tiny, 0, function="local-stage-0"))[0]
        assert infer(first.url) == infer(second.url) == infer(local.url)
        missing = StageSpec("gone-stage-0", env={**remote.env, "QUART_MODEL_URL": "s3://models/never/there"})
        with pytest.raises(KeysManagerError) as err:
            d.client.start(missing)
        assert err.value.status == 502 and "no such object" in err.value.message
        assert d.client.health()  # and it keeps serving


def test_a_keysmanager_lands_a_fetched_stage_in_its_landing_reserve(endpoint, tiny, monkeypatch) -> None:
    """``--landing-mb``: the agent fills its reserve after it starts (health says so), the first stage it fetches
    lands in the reserve's pages (the same inode, renamed), verified; the reserve is refilled later, not at once."""
    from support.keysmanager import Daemon, daemons_in_temp_dir

    from keysmanager.types import StageSpec

    monkeypatch.setenv("QUART_REGISTRY_ENDPOINT", endpoint)
    remote = StageSpec("tiny-stage-1", env={"QUART_MODEL_URL": "s3://models/cli/tiny", "QUART_STAGE_INDEX": "1",
                                            "QUART_COMPUTE": "cpu"})
    with daemons_in_temp_dir() as (root, daemons, _):
        d = Daemon(root, "land", "--landing-mb", "2")
        daemons.append(d)
        d.start()
        deadline = time.monotonic() + 30
        while (landing := d.client.health()["landing"])["state"] != "ready":
            assert time.monotonic() < deadline, landing
            time.sleep(0.05)
        assert landing == {"state": "ready", "bytes": 2 << 20, "target_bytes": 2 << 20, "taken": 0}
        reserve = d.state_dir / "landing" / "reserve"
        inode = reserve.stat().st_ino
        d.client.ensure_cached(remote)
        [fetched] = (d.state_dir / "registry").glob("*-1/stage-1.safetensors")
        assert fetched.stat().st_ino == inode and not reserve.exists()
        assert fetched.read_bytes() == (tiny / "stage-1.safetensors").read_bytes()
        after = d.client.health()["landing"]
        assert after["taken"] == 1 and after["state"] == "filling" and after["bytes"] == 0
