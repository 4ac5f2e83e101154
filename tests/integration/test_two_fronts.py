"""One behaviour, two fronts (issue 40): the same end-to-end matrix against the embedded gateway and against the
standalone plugin (``python -m gateway_plugin.standalone``'s app) in front of that gateway, standing in for
OpenFaaS, with real stage replicas: the random ``tiny`` llama and MiniLM (tests/support/two_fronts.py).

Every answer is checked against the whole model (``quart_stage.verify.reference_model``; greedy tokens against
transformers' ``generate``), so the two fronts are held to the same numbers. The standalone front answered 502
on every one-shot call of a real model before ``OpenFaaSView`` implemented the whole ``ReplicaSource``
(``note_held``: the ``X-Quart-Layers-Held`` of a stage with a manifest)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import openai
import pytest
import requests
import torch
from gateway_plugin.generation.tokens import load_model
from quart_stage import wire
from quart_stage.verify import reference_model
from support.callbacks import CallbackServer
from support.tiny_llama import greedy
from support.two_fronts import FRONTS, STAGES, Deployment, Front, scale_bound, scale_to_zero
from tokenizers import Tokenizer

TOL = 1e-4
JSON = {"Accept": "application/json"}
IDS = [1, 2, 3, 4, 5]
SENTENCES = ["pipelines on functions", "a longer sentence, so that the batch is padded to it", "short"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("fronts"))
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module", params=FRONTS)
def front(request, deployment) -> Front:
    return deployment.front(request.param)


@pytest.fixture(scope="module")
def reference(deployment):
    """What the whole models answer: tiny's logits for IDS, MiniLM's embeddings of SENTENCES (padded batch)."""
    tiny = reference_model(str(deployment.dirs["tiny"]))
    minilm_dir = deployment.dirs["minilm"]
    manifest = json.loads((minilm_dir / "manifest.json").read_text())
    enc = Tokenizer.from_file(str(minilm_dir / manifest["tokenizer"])).encode_batch(SENTENCES)
    longest = max(len(e.ids) for e in enc)
    ids = torch.tensor([e.ids + [0] * (longest - len(e.ids)) for e in enc])
    mask = torch.tensor([[1] * len(e.ids) + [0] * (longest - len(e.ids)) for e in enc])
    with torch.inference_mode():
        logits = tiny(torch.tensor([IDS])).logits
        embeddings = reference_model(str(minilm_dir))(input_ids=ids, attention_mask=mask).logits
    return {"tiny": tiny, "logits": logits, "embeddings": embeddings}


def close_to(got, want: torch.Tensor) -> bool:
    return torch.allclose(torch.as_tensor(got, dtype=torch.float32), want, atol=TOL, rtol=TOL)


def answered(res: requests.Response) -> bool:
    """A 200, or an explicit error: a 4xx/5xx whose JSON body says what went wrong."""
    if res.status_code == 200:
        return True
    try:
        return res.status_code >= 400 and bool(res.json().get("error"))
    except ValueError:
        return False


# ---------------------------------------------------------------- one-shot pipeline, batch, async


def test_one_shot_pipeline_answers_json_and_safetensors(front, reference):
    res = front.post("/function/tiny", json={"input_ids": [IDS]}, headers=JSON)
    assert res.status_code == 200, res.text  # the standalone front answered 502 here (OpenFaaSView.note_held)
    doc = res.json()
    assert (doc["model"], doc["output"], doc["shape"]) == ("tiny", "logits", [1, len(IDS), 512])
    assert close_to(doc["data"], reference["logits"])
    res = front.post("/function/tiny", json={"input_ids": [IDS]})
    assert res.status_code == 200 and res.headers["Content-Type"] == wire.CONTENT_TYPE, res.text
    assert close_to(wire.decode(res.content).tensors["logits"], reference["logits"])
    res = front.post("/function/minilm", json={"text": SENTENCES[0]}, headers=JSON)
    assert res.status_code == 200, res.text
    assert res.json()["shape"] == [1, 384] and close_to(res.json()["data"], reference["embeddings"][:1])


def test_a_padded_batch_answers_what_each_sentence_gets_alone(front, reference):
    res = front.post("/function/minilm", json={"text": SENTENCES}, headers=JSON)
    assert res.status_code == 200, res.text
    assert res.json()["shape"] == [len(SENTENCES), 384] and close_to(res.json()["data"], reference["embeddings"])
    for i, sentence in enumerate(SENTENCES):
        alone = front.post("/function/minilm", json={"text": sentence}, headers=JSON)
        assert alone.status_code == 200 and close_to(alone.json()["data"], reference["embeddings"][i:i + 1])


def test_an_async_call_answers_its_callback(request, front, reference):
    if front.name == "standalone":  # OpenFaaS's queue-worker calls /function/<name>: a stage, never a pipeline
        request.applymarker(pytest.mark.xfail(strict=True, reason="the standalone plugin serves no "
                                                                  "/async-function yet (issue 40)"))
    callbacks = CallbackServer()
    try:
        res = front.post("/async-function/minilm", json={"text": SENTENCES[2]},
                         headers={**JSON, "X-Callback-Url": callbacks.url})
        assert res.status_code == 202, res.text
        headers, body = callbacks.next(timeout=60)
        assert headers["X-Call-Id"] == res.headers["X-Call-Id"] and headers["X-Function-Status"] == "200"
        assert close_to(json.loads(body)["data"], reference["embeddings"][2:3])
    finally:
        callbacks.close()


# ---------------------------------------------------------------- generation


def test_generation_through_v1_streamed_and_not_is_transformers_greedy(front, deployment, reference):
    tokenizer = load_model("tiny", str(deployment.dirs["tiny"])).tokenizer
    prompt = "Pipelines stream"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    want = greedy(reference["tiny"], ids, 8)
    direct = front.post("/function/tiny", json={"input_ids": ids, "max_tokens": 8, "ignore_eos": True})
    assert direct.status_code == 200 and direct.json()["tokens"] == want, direct.text
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert "tiny" in [m.id for m in client.models.list().data]
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 8 and answer.choices[0].text == tokenizer.decode(want)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == answer.choices[0].text
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert chat.usage.completion_tokens >= 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages)


# ---------------------------------------------------------------- scaling, a replica killed, scale from zero


def test_scaled_through_the_controller_a_replica_killed_mid_load_every_request_answered(front, deployment,
                                                                                        reference):
    """``com.openfaas.scale.max`` of MiniLM's stage 1 raised to 2: the static policy scales it there (both plugins
    run on this deployment: the embedded one through its gateway actuator, the standalone one through its REST
    actuator, ``POST /system/scale-function``), the front dispatches to both; one of the two killed (SIGKILL)
    under load: every request answered, 200 or an explicit error; back to 1 after."""
    stage = "minilm-stage-1"
    scale_bound(deployment, stage, 2)
    try:
        front.wait_sees({stage: 2})
        body, want = {"text": SENTENCES[1]}, reference["embeddings"][1:2]

        def kill_one() -> int:
            time.sleep(0.5)  # load running
            victim = deployment.replica_pids(stage)[0]
            os.kill(victim, signal.SIGKILL)
            return victim

        def call(_: int) -> requests.Response:
            return front.post("/function/minilm", json=body, headers={**JSON, "X-Quart-Timeout-Ms": "30000"})

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            killer = pool.submit(kill_one)
            answers = list(pool.map(call, range(40)))
            killer.result(timeout=30)
        statuses = [r.status_code for r in answers]
        assert all(answered(r) for r in answers), statuses
        assert statuses.count(200) >= 36, statuses  # the survivor carries the rest (a retry on it)
        assert all(close_to(r.json()["data"], want) for r in answers if r.status_code == 200)
    finally:
        scale_bound(deployment, stage, 1)
    front.wait_sees({stage: 1})
    res = front.post("/function/minilm", json={"text": SENTENCES[0]}, headers=JSON)
    assert res.status_code == 200 and close_to(res.json()["data"], reference["embeddings"][:1])


def test_a_model_at_zero_starts_on_its_first_call(front, deployment, reference):
    scale_to_zero(deployment, "zt")
    front.wait_sees({f"zt-stage-{i}": 0 for i in range(STAGES)})
    time.sleep(1.0)  # five control periods with no call: nothing starts
    assert all(deployment.listing()[f"zt-stage-{i}"]["replicas"] == 0 for i in range(STAGES))
    res = front.post("/function/zt", json={"input_ids": [IDS]}, headers={**JSON, "X-Quart-Timeout-Ms": "60000"},
                     timeout=90)
    assert res.status_code == 200 and res.json()["shape"] == [1, len(IDS), 512], res.text
    assert close_to(res.json()["data"], reference["logits"])  # zt is tiny, partitioned with the same seed
