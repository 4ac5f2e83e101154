"""A model only the registry holds (stage 0 deployed with ``QUART_MODEL_URL``, as every ParaServe start is) is
served by the generation API: its tokenizer and chat template are fetched from a real S3-compatible server
(moto's, ephemeral port) into the gateway's cache; an unreachable registry is a 503 that names it."""

from __future__ import annotations

import os

import openai
import pytest
import requests
from gateway_plugin.generation.tokens import load_model
from support.fake_session_stage import reference
from support.generation_app import GenerationServer, tiny_models
from support.live_registry import moto_s3

from keysmanager.registry import ModelRegistry

URL = "s3://models/gen/tiny"
ENC_URL = "s3://models/gen/enc"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("reg")
    with moto_s3(root):
        dirs = tiny_models(root / "models")
        ModelRegistry(URL).upload(dirs["tiny"])
        ModelRegistry(ENC_URL).upload(dirs["enc"])
        yield dirs, root


@pytest.fixture(scope="module")
def server(registry):
    dirs, root = registry
    running = GenerationServer({"tiny": URL, "enc": ENC_URL, "gone": "s3://models/nowhere/x"},
                               tokenizer_cache=str(root / "cache"), default_max_tokens=8)
    try:
        yield running
    finally:
        running.close()


def test_a_registry_model_is_listed_and_answers_with_its_chat_template(registry, server):
    dirs, root = registry
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == ["tiny"]  # the encoder and the missing model are not
    tiny = load_model("tiny", dirs["tiny"])  # the local partition: what the fetched copy must equal
    messages = [{"role": "user", "content": "What is 2+2?"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    rendered = tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tiny.tokenizer.encode(rendered, add_special_tokens=False)
    assert answer.choices[0].message.content == tiny.decode(reference(ids, 10))
    assert answer.usage.prompt_tokens == len(ids)
    cached = [p for p in (root / "cache").iterdir()]
    assert len(cached) == 2  # tiny and enc, one folder each, private to the gateway's user
    assert oct(os.stat(root / "cache").st_mode & 0o777) == "0o700"
    assert sorted(f.name for f in next(p for p in cached if (p / "tokenizer_config.json").exists()).iterdir()) == [
        "manifest.json", "tokenizer.json", "tokenizer_config.json"]  # no stage weights


def test_an_unreachable_registry_model_is_a_503_naming_it(server):
    answer = requests.post(f"{server.url}/v1/completions", json={"model": "gone", "prompt": "hi", "max_tokens": 2},
                           timeout=30)
    assert answer.status_code == 503
    message = answer.json()["error"]["message"]
    assert "s3://models/nowhere/x" in message and "registry" in message
