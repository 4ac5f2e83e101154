"""``POST /v1/embeddings`` (gateway_plugin.generation.embeddings) through the ``openai`` client, over real MiniLM
stages (real weights, mean pooling) behind the pipeline router with dynamic batching: the vectors equal what
``POST /function/minilm`` answers for each text (1e-6), both encodings, token-id inputs, usage; a decoder or an
encoder without a pooling head, an unknown field, ``dimensions`` and a context overflow are 400s naming the
field."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import requests
import torch
from aiohttp import web
from gateway_plugin.batching import BatchLimits
from gateway_plugin.config import PluginConfig
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.openai_api import GenerationAPI
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.router import Router, StaticReplica, StaticReplicas
from quart_stage import wire
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_tools.partition import partition
from support.generation_app import BackgroundLoop
from support.stage_server import StageServer
from tokenizers import Tokenizer

STAGES = 2
TEXTS = ["A man is eating food.", "The new movie is awesome", "A cheetah chases its prey across a field.",
         "hi", "Serving sentence embeddings through a pipeline of stages, batched where they meet."]


class EmbeddingServer(BackgroundLoop):
    """Two MiniLM stage replicas, the router (batches of up to 8) and the generation API on a background loop;
    ``url`` serves ``/v1/...`` and ``/function/<model>`` (the router's one-shot path)."""

    def __init__(self, dirs: dict[str, str]) -> None:
        super().__init__()
        self.dirs = dirs
        self.collector = MetricsCollector(10.0)
        self.url = self.call(self._start(), timeout=60)

    async def _start(self) -> str:
        source = StaticReplicas()
        self.stages = []
        for i in range(STAGES):
            rt = StageRuntime.load(StageConfig(model_dir=self.dirs["minilm"], stage_index=i, num_stages=STAGES,
                                               threads=1))
            self.stages.append(await StageServer(rt, delay_s=0.05).start())
            source.replicas[f"minilm-stage-{i}"] = [StaticReplica(f"minilm#{i}", self.stages[i].url)]
        pipelines = {name: [f"{name}-stage-{i}" for i in range(STAGES)] for name in self.dirs}
        self.router = Router(source, lambda: pipelines, PluginConfig(), self.collector, dispatch_poll_s=0.005,
                             batch_limits=lambda fn: BatchLimits(8))
        config = GenerationConfig(replica_wait_s=0.5)
        self.engine = SessionEngine(source, config)
        self.api = GenerationAPI(self.engine, lambda: pipelines, self.dirs.get, config, self.collector,
                                 one_shot=self.router.answer)
        app = web.Application(client_max_size=1 << 24)
        app.router.add_route("*", "/v1/{tail:.*}", self.api.v1)
        app.router.add_post("/function/{model}", lambda r: self.router.handle(r, r.match_info["model"]))
        app.router.add_get("/metrics", lambda r: web.Response(body=self.collector.prometheus_text()))
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.router.close()
        await self.engine.close()
        for stage in self.stages:
            await stage.runner.cleanup()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("embeddings")
    dirs = {"minilm": str(root / "minilm"), "tiny": str(root / "tiny"), "enc": str(root / "enc")}
    for name, preset in (("minilm", "minilm"), ("tiny", "tiny"), ("enc", "tiny-encoder")):
        partition(preset, STAGES, dirs[name], progress=False)
    running = EmbeddingServer(dirs)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def function_vector(server, text: str) -> torch.Tensor:
    """What ``POST /function/minilm`` answers for ``text`` (the pooled, normalised embedding)."""
    res = requests.post(f"{server.url}/function/minilm", json={"text": text}, timeout=60)
    assert res.status_code == 200, res.text
    out = wire.decode(res.content).tensors["logits"]
    assert out.shape == (1, 384)
    return out[0].clone()


def test_embeddings_equal_the_function_answer_and_are_batched(server, client):
    rows_before = list(server.stages[0].rows)
    answer = client.embeddings.create(model="minilm", input=TEXTS)  # the client asks base64 and decodes it
    assert [d.index for d in answer.data] == list(range(len(TEXTS))) and answer.model == "minilm"
    tok = Tokenizer.from_file(f"{server.dirs['minilm']}/tokenizer.json")
    tokens = sum(len(tok.encode(t).ids) for t in TEXTS)
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (tokens, tokens)
    calls = server.stages[0].rows[len(rows_before):]
    assert sum(calls) == len(TEXTS) and max(calls) > 1, calls  # the inputs shared stage calls (packed)
    floats = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    for text, got, plain in zip(TEXTS, answer.data, floats.data, strict=True):
        want = function_vector(server, text)
        assert np.abs(np.asarray(got.embedding) - want.numpy()).max() <= 1e-6
        assert np.abs(np.asarray(plain.embedding) - want.numpy()).max() <= 1e-6
        assert abs(float(np.linalg.norm(plain.embedding)) - 1.0) < 1e-5  # MiniLM's vectors are unit length
    one = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and np.abs(np.asarray(one.data[0].embedding) - function_vector(server, TEXTS[0]).numpy()).max() <= 1e-6
    ids = tok.encode(TEXTS[1]).ids  # token ids are embedded as given
    by_ids = client.embeddings.create(model="minilm", input=[ids, ids[:4]], encoding_format="float")
    assert np.abs(np.asarray(by_ids.data[0].embedding) - function_vector(server, TEXTS[1]).numpy()).max() <= 1e-6
    assert by_ids.usage.prompt_tokens == len(ids) + 4
    same = client.embeddings.create(model="minilm", input=TEXTS[2], dimensions=384, encoding_format="float")
    assert len(same.data[0].embedding) == 384  # the model's own width is honoured


def _error(res: requests.Response, status: int, param: str) -> dict:
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert err["param"] == param and err["message"], err
    return err


def test_what_embeddings_cannot_do_is_refused_by_name(server, client):
    url = f"{server.url}/v1/embeddings"
    err = _error(requests.post(url, json={"model": "tiny", "input": "x"}, timeout=30), 400, "model")
    assert "decoder" in err["message"] and "/v1/completions" in err["message"]
    assert "pooling" in _error(requests.post(url, json={"model": "enc", "input": "x"}, timeout=30), 400,
                               "model")["message"]
    assert _error(requests.post(url, json={"model": "nope", "input": "x"}, timeout=30), 404,
                  "model")["code"] == "model_not_found"
    _error(requests.post(url, json={"model": "minilm", "input": "x", "dimensions": 64}, timeout=30), 400, "dimensions")
    _error(requests.post(url, json={"model": "minilm", "input": "x", "truncate_prompt_tokens": 8}, timeout=30), 400,
           "truncate_prompt_tokens")
    _error(requests.post(url, json={"model": "minilm", "input": "x", "encoding_format": "int8"}, timeout=30), 400,
           "encoding_format")
    for bad in ([], "", [""], [[]], [1.5], [["a"]], None, {"text": "x"}, [[-1]]):
        _error(requests.post(url, json={"model": "minilm", "input": bad}, timeout=30), 400, "input")
    _error(requests.post(url, json={"model": "minilm", "input": ["x"] * 2049}, timeout=30), 400, "input")
    _error(requests.post(url, json={"model": "minilm", "input": [[5] * 8, [40_000]]}, timeout=30), 400, "input")
    with pytest.raises(openai.BadRequestError) as long_input:
        client.embeddings.create(model="minilm", input=[[101] * 600])
    err = long_input.value.body
    assert err["message"].startswith("This model's maximum context length is 512 tokens. However, you requested 600")
    assert (err["code"], err["param"]) == ("context_length_exceeded", "input")
    _error(requests.get(url, timeout=30), 405, "method")


def test_models_list_the_embedding_pipeline_and_metrics_count_it(server, client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"minilm", "tiny"}  # "enc" (no pooling head) serves neither door
    assert (cards["minilm"].max_model_len, cards["minilm"].root) == (512, "minilm")
    client.embeddings.create(model="minilm", input=["count", "me"])
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    assert 'vllm:e2e_request_latency_seconds_count{model_name="minilm"}' in text
    assert 'vllm:num_requests_running{model_name="minilm"} 0.0' in text


def test_the_routers_refusal_is_the_answer(server, client):
    """A 429 of the router's queues (or any error it answers) is the request's answer, its Retry-After kept."""
    from gateway_plugin.router import json_reply

    embeddings = server.api.embeddings
    kept = embeddings.one_shot

    async def full(model, method, tail, headers, body):
        return json_reply(429, "stage 'minilm-stage-0' already has 1024 requests waiting", None, **{"Retry-After": "3"})

    embeddings.one_shot = full
    try:
        res = requests.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": ["a", "b"]}, timeout=30)
    finally:
        embeddings.one_shot = kept
    assert res.status_code == 429 and res.headers["Retry-After"] == "3", res.text
    assert res.json()["error"]["type"] == "rate_limit_error" and "1024 requests" in res.json()["error"]["message"]
    assert len(client.embeddings.create(model="minilm", input="back").data) == 1
