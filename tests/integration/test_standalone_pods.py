"""Pods addressed directly on Kubernetes (issue 40): the standalone plugin with ``QUART_PLATFORM=kubernetes`` reads
each stage's pods from a fake EndpointSlice API and calls them directly. The pods are real stage replicas (the
stage's WSGI app over the random ``tiny`` decoder, 2 stages, 3 pods each) on loopback: 16 generation sessions keep
their pods (0 replays, every session's steps on one pod per stage, no 409), a pod removed from its slices
mid-stream gives its sessions up to the other pods by replay, and a pod that dies while still listed fails its
sessions over by replay; every stream token-identical to transformers' greedy ``generate``."""

from __future__ import annotations

import asyncio
import collections
import json
import random

import aiohttp
import pytest
import torch
from quart_stage.verify import reference_model
from quart_tools.partition import partition
from support.kubernetes_pods import PodCluster

STAGES = ("tiny-stage-0", "tiny-stage-1")
SESSIONS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pods") / "tiny"
    partition("tiny", 2, str(folder), stack={"compute": "cpu"}, progress=False)
    whole = reference_model(str(folder))
    whole.generation_config.eos_token_id = None
    whole.generation_config.pad_token_id = 0
    return folder, whole


@pytest.fixture
def cluster(model, tmp_path):
    c = PodCluster(tmp_path, model[0] / "stack.yml", {fn: 3 for fn in STAGES})
    try:
        c.wait_ready()
        yield c
    finally:
        c.close()


def prompts() -> list[list[int]]:
    return [[random.Random(i).randrange(3, 100) for _ in range(3 + i % 7)] for i in range(SESSIONS)]


def greedy(whole, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = whole.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, use_cache=True)
    return out[0, len(ids):].tolist()


async def stream(http: aiohttp.ClientSession, url: str, ids: list[int], n: int, seen: list[int], i: int):
    """One streamed generation on ``/function/tiny``: (its tokens, its last event)."""
    tokens: list[int] = []
    final: dict = {}
    async with http.post(f"{url}/function/tiny", json={"input_ids": ids, "max_tokens": n, "stream": True,
                                                       "ignore_eos": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "token" in event:
                tokens.append(event["token"])
                seen[i] = len(tokens)
            elif "text" not in event:
                final = event
    return tokens, final


async def run(url: str, n: int, mid_stream=None):
    """``SESSIONS`` streams at once; ``mid_stream()`` is awaited once half of them have 3 tokens (a pod's steps go
    to its running sessions first, so the others are still at their start)."""
    seen = [0] * SESSIONS
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as http:
        tasks = [asyncio.create_task(stream(http, url, p, n, seen, i)) for i, p in enumerate(prompts())]
        if mid_stream is not None:
            while sum(k >= 3 for k in seen) < SESSIONS // 2:
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                await asyncio.sleep(0.01)
            await mid_stream()
        return await asyncio.gather(*tasks)


def test_sixteen_sessions_keep_their_pods_with_three_pods_a_stage(cluster, model) -> None:
    results = asyncio.run(run(cluster.url, 12))
    for ids, (tokens, final) in zip(prompts(), results, strict=True):
        assert tokens == greedy(model[1], ids, 12)
        assert final["finish_reason"] == "length" and final["replays"] == 0
    assert cluster.plugin.engine.moves == 0
    for fn in STAGES:
        by_pod = cluster.sessions_by_pod(fn)
        pods_of = collections.Counter(sid for sessions in by_pod.values() for sid in sessions)
        assert len(pods_of) == SESSIONS and set(pods_of.values()) == {1}  # each session's steps on one pod
        # spread over all three; how evenly depends on when each session finds a pod free (the pick rule: least in
        # flight, then least booked), so a loaded CI run once put a single session on one pod
        assert all(sessions for sessions in by_pod.values()), by_pod
        assert all(steps == 12 for sessions in by_pod.values() for steps in sessions.values())  # prefill + 11
        assert {status for pod in cluster.pods[fn] for _, status in pod.steps} == {200}  # never a 409
    assert cluster.plugin.engine.book.reserved == {}


def test_a_pod_removed_from_its_slices_mid_stream_hands_its_sessions_over_by_replay(cluster, model) -> None:
    engine = cluster.plugin.engine
    removed: dict = {}

    async def remove_busiest_pod() -> None:
        on = collections.Counter(s.replicas[0].id for s in list(engine.active.values()) if len(s.generated) >= 3)
        pod = next(p for p in cluster.pods[STAGES[0]] if p.name == on.most_common(1)[0][0].split("@")[0])
        pinned = [s for s in list(engine.active.values()) if s.replicas[0].id.startswith(pod.name + "@")]
        removed.update(pod=pod, sessions={s.id for s in pinned}, mark=len(pod.steps),
                       running=sum(1 for s in pinned if len(s.generated) >= 3),
                       going_on=sum(1 for s in pinned if s.max_tokens - len(s.generated) >= 2))
        await cluster.remove(pod)

    results = asyncio.run(run(cluster.url, 24, remove_busiest_pod))
    for ids, (tokens, final) in zip(prompts(), results, strict=True):
        assert tokens == greedy(model[1], ids, 24)  # identical after the move
        assert final["finish_reason"] == "length" and final["replays"] == 0  # moved, never failed
    pod, sessions = removed["pod"], removed["sessions"]
    assert removed["running"] >= 1  # mid-stream; each of its sessions with a step to go moved once, by replay
    assert 1 <= removed["going_on"] <= engine.moves <= len(sessions)
    late = collections.Counter(sid for sid, _ in pod.steps[removed["mark"]:])
    assert set(late) <= sessions and set(late.values()) <= {1}  # at most the step each had on its way there
    assert sorted(p.id.split("@")[0] for p in cluster.plugin.view.ready(STAGES[0])) == sorted(
        p.name for p in cluster.pods[STAGES[0]] if p is not pod)
    assert engine.book.reserved == {}


def test_a_pod_that_dies_while_listed_fails_its_sessions_over_by_replay(cluster, model) -> None:
    engine, stage = cluster.plugin.engine, STAGES[1]
    killed: dict = {}

    async def kill_busiest_pod() -> None:
        on = collections.Counter(s.replicas[1].id for s in list(engine.active.values()) if len(s.generated) >= 3)
        pod = next(p for p in cluster.pods[stage] if p.name == on.most_common(1)[0][0].split("@")[0])
        killed.update(pod=pod, prompts=[s.prompt for s in list(engine.active.values())
                                        if s.replicas[1].id.startswith(pod.name + "@")])
        await asyncio.to_thread(pod.stop)  # its slice still lists it ready

    results = asyncio.run(run(cluster.url, 24, kill_busiest_pod))
    failed_over = 0
    for ids, (tokens, final) in zip(prompts(), results, strict=True):
        assert tokens == greedy(model[1], ids, 24)  # identical after the failover
        assert final["finish_reason"] == "length"
        assert final["replays"] <= (1 if ids in killed["prompts"] else 0)  # one replay at most, on its sessions
        failed_over += final["replays"]
    assert failed_over >= 1 and engine.moves == 0
    assert engine.book.reserved == {}
