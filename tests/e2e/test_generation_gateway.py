"""Generation through a running embedded gateway (`quartctl up` in-process, KeysManager host, real stage
replicas of the ``tiny`` decoder at 3 stages): the ``openai`` client against ``/v1`` (completions and chat,
streamed and not), tokens identical to transformers' greedy ``generate`` on the whole model, errors in
OpenAI's shape, and a stage replica ``kill -9``'d mid-stream: the stream goes on, the tokens identical."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import psutil
import pytest
import requests
import torch
from gateway_plugin.generation.tokens import load_model
from quart_stage.verify import reference_model
from quart_tools.partition import partition
from support.embedded_system import deploy_stack, stage_system, wait_available
from support.generation_app import CHATML


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    model_dir = root / "tiny"
    partition("tiny", 3, str(model_dir), stack={"compute": "cpu"}, progress=False)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "chat_template": CHATML}))
    system = stage_system(root)
    try:
        deploy_stack(system, model_dir)
        requests.post(f"{system.url}/system/scale-function/tiny-stage-1", json={"serviceName": "tiny-stage-1",
                      "replicas": 2}, auth=system.auth, timeout=10)
        wait_available(system, {"tiny-stage-0": 1, "tiny-stage-1": 2, "tiny-stage-2": 1})
        yield system, str(model_dir)
    finally:
        system.close()


@pytest.fixture(scope="module")
def whole(gateway):
    return reference_model(gateway[1])


def greedy(whole, ids: list[int], n: int) -> list[int]:
    whole.generation_config.eos_token_id = None
    whole.generation_config.pad_token_id = 0
    with torch.inference_mode():
        out = whole.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, use_cache=True)
    return out[0, len(ids):].tolist()


def test_openai_client_completions_and_chat_streamed_and_not(gateway, whole):
    system, model_dir = gateway
    client = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    answer = client.completions.create(model="tiny", prompt="Pipelines stream", max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    ids = load_model("tiny", model_dir).tokenizer.encode("Pipelines stream", add_special_tokens=False)
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 10
    direct = requests.post(f"{system.url}/function/tiny", json={"input_ids": ids, "max_tokens": 10,
                                                                "ignore_eos": True}, timeout=60).json()
    assert direct["tokens"] == greedy(whole, ids, 10)  # token-identical to transformers' generate
    streamed = client.completions.create(model="tiny", prompt="Pipelines stream", max_tokens=10, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == answer.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    metrics = requests.get(f"{system.url}/metrics", timeout=10).text
    assert 'quart_generation_tpot_seconds_count{model="tiny"}' in metrics


def test_penalties_bias_and_logprobs_through_real_stages_equal_transformers(gateway, whole):
    """The sampler's fields through the gateway and three real stages: greedy with a repetition penalty and a logit
    bias gives transformers' generate with RepetitionPenalty and SequenceBias; the logprobs are its raw logits'."""
    system, model_dir = gateway
    client = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=60)
    tokenizer = load_model("tiny", model_dir).tokenizer
    ids = tokenizer.encode("Pipelines stream", add_special_tokens=False)
    whole.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = whole.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0,
                             repetition_penalty=1.8, sequence_bias={(40,): 2.0}, output_logits=True,
                             return_dict_in_generate=True)
    want = out.sequences[0, len(ids):].tolist()
    answer = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=2,
                                       logit_bias={"40": 2.0}, extra_body={"repetition_penalty": 1.8,
                                                                            "ignore_eos": True})
    lp = answer.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in want] and want != greedy(whole, ids, 8)
    raw = [torch.log_softmax(x[0].float(), dim=-1) for x in out.logits]
    assert lp.token_logprobs == pytest.approx([float(r[t]) for r, t in zip(raw, want, strict=True)], abs=1e-4)


def _pid_listening(url: str) -> int:
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def test_a_stage_replica_killed_mid_stream_fails_over_and_the_tokens_are_identical(gateway, whole):
    system, _ = gateway
    ids = [7, 8, 9, 10, 11]
    events: list[dict] = []
    killed = threading.Event()

    def kill_when_started():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(events) < 3:
            time.sleep(0.005)
        plugin_engine = system.system.gateway.invoke_hooks[0].__self__.engine
        [session] = plugin_engine.active.values()
        os.kill(_pid_listening(session.replicas[1].url), signal.SIGKILL)
        killed.set()

    killer = threading.Thread(target=kill_when_started)
    killer.start()
    with requests.post(f"{system.url}/function/tiny", json={"input_ids": ids, "max_tokens": 40, "stream": True,
                                                            "ignore_eos": True}, stream=True, timeout=120) as res:
        for line in res.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if not killed.is_set():
                    time.sleep(0.02)  # slow the stream until the kill lands
            elif line == "data: [DONE]":
                events.append({"done": True})
    killer.join(10)
    assert killed.is_set() and events[-1] == {"done": True}
    tokens = [e["token"] for e in events if "token" in e]
    assert tokens == greedy(whole, ids, 40)
    assert events[-2]["finish_reason"] == "length" and events[-2]["replays"] >= 1
    sessions = requests.get(f"{system.url}/function/quart-plugin/sessions", timeout=10).json()
    assert sessions["active"] == [] and sessions["kv"] == {}  # nothing in flight, nothing booked


def test_quartctl_invoke_streams_a_generation(gateway, whole):
    """`quartctl invoke <model>` with a generation body that asks for a stream prints the events as they come."""
    import subprocess
    import sys

    system, model_dir = gateway
    ids = load_model("tiny", model_dir).tokenizer.encode("Pipelines stream", add_special_tokens=False)
    body = json.dumps({"input_ids": ids, "max_tokens": 6, "ignore_eos": True, "stream": True})
    res = subprocess.run([sys.executable, "-m", "quart_tools.cli", "invoke", "tiny", "--gateway", system.url,
                          "-d", body], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    events = [line[len("data: "):] for line in res.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", res.stdout
    tokens = [json.loads(e)["token"] for e in events[:-1] if "token" in json.loads(e)]
    assert tokens == greedy(whole, ids, 6)


def test_a_stage_scaled_2_to_1_mid_stream_drains_by_replay_and_the_tokens_are_identical(gateway, whole):
    """Scale-down while streams run on the replica that leaves: it is drained (its sessions move by replay),
    stopped once they are gone, and every stream ends with the tokens of an undisturbed run."""
    system, _ = gateway
    gw = system.system.gateway
    engine = gw.invoke_hooks[0].__self__.engine
    stage = gw.functions["tiny-stage-1"]
    deadline = time.monotonic() + 120
    while len(stage.ready) < 2:  # the replica the kill test took is back
        assert time.monotonic() < deadline, "tiny-stage-1 never had 2 ready replicas again"
        time.sleep(0.1)
    before = {r.id for r in stage.ready}
    prompts = [[7 + i, 8, 9 + 2 * i, 10] for i in range(4)]
    streams: dict[int, list[dict]] = {}

    def stream(i: int) -> None:
        events: list[dict] = []
        with requests.post(f"{system.url}/function/tiny", json={"input_ids": prompts[i], "max_tokens": 96,
                           "stream": True, "ignore_eos": True}, stream=True, timeout=180) as res:
            for line in res.iter_lines(decode_unicode=True):
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                elif line == "data: [DONE]":
                    events.append({"done": True})
        streams[i] = events

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    moves_before = engine.moves
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(engine.active) < len(prompts) or not all(engine.book.booked(rid) > 0 for rid in before):
        # every stream placed, sessions on both replicas of the stage
        assert time.monotonic() < deadline, engine.book.occupancy()
        time.sleep(0.002)
    held = {rid: engine.book.booked(rid) for rid in before}
    scaled_at = time.monotonic()
    switched = requests.post(f"{system.url}/function/quart-plugin/policy", auth=system.auth, timeout=10,
                             json={"policy": "static", "config": {"replicas": 1}})  # the controller keeps it at 1
    assert switched.status_code == 200, switched.text
    res = requests.post(f"{system.url}/system/scale-function/tiny-stage-1", auth=system.auth, timeout=10,
                        json={"serviceName": "tiny-stage-1", "replicas": 1})
    assert res.status_code in (200, 202), res.text
    deadline = time.monotonic() + 60
    while len(stage.replicas) > 1:  # the one that left is stopped once its sessions have moved
        assert time.monotonic() < deadline, {r.id: r.state for r in stage.replicas.values()}
        time.sleep(0.01)
    gone_s = time.monotonic() - scaled_at
    running = sum(t.is_alive() for t in threads)
    for t in threads:
        t.join(180)
    [left] = before - set(stage.replicas)
    assert 0 < held[left] == min(held.values())  # it held sessions, the fewest booked positions of the two
    for i, prompt in enumerate(prompts):
        events = streams[i]
        assert events[-1] == {"done": True} and events[-2]["finish_reason"] == "length", events[-3:]
        assert [e["token"] for e in events if "token" in e] == greedy(whole, prompt, 96)
    assert engine.moves > moves_before  # by replay, not by waiting the drain out
    assert running > 0 and gone_s < gw.config.drain_timeout_s  # stopped while streams ran, not at the drain bound
    sessions = requests.get(f"{system.url}/function/quart-plugin/sessions", timeout=10).json()
    assert sessions["active"] == [] and sessions["kv"] == {}
    deadline = time.monotonic() + 30
    while True:  # the controller's snapshot shows the stage's KV capacity (one ready replica's cap) and no session
        snap = requests.get(f"{system.url}/function/quart-plugin/snapshot", timeout=10).json()["tiny"]["stages"][1]
        # the snapshot is the controller's last step (every control period): wait for one after the streams
        if snap["replicas"] == 1 and snap["kv_capacity"] > 0 and snap["sessions"] == 0:
            break
        assert time.monotonic() < deadline, snap
        time.sleep(0.2)
    assert snap["sessions"] == 0 and snap["kv_tokens"] == 0 and snap["kv_capacity"] == engine.book.cap(
        next(iter(stage.replicas)))
