"""Router: pipelining through fake replicas, retries on replica death, 429 at the queue cap, and
10,000 requests with random replica kills where every request gets exactly one response."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

from support.router_cluster import Cluster, make_router, routed, with_cluster


@with_cluster
async def test_pipeline_runs_stages_in_order_over_http(cluster: Cluster) -> None:
    async with routed(cluster) as (router, client):
        resp = await client.post("/function/m", data=b"x")
        assert resp.status == 200
        assert await resp.read() == b"x|m-stage-0#1|m-stage-1#2"
        missing = await client.post("/function/nope", data=b"x")
        assert missing.status == 404 and (await missing.json())["field"] == "model"
        bad = await client.post("/function/m", data=b"x", headers={"X-Quart-Timeout-Ms": "soon"})
        assert bad.status == 400 and "X-Quart-Timeout-Ms" in (await bad.json())["error"]
        # the client's Accept reaches the last stage only (it picks the answer's format; the others exchange bytes)
        resp = await client.post("/function/m", data=b"y", headers={"Accept": "application/json"})
        assert resp.status == 200
        first, last = cluster.fakes["r1"], cluster.fakes["r2"]
        assert last.accepts[-1] == "application/json" and first.accepts[-1] != "application/json"
    st = router.collector.stage("m-stage-1")
    assert st.total_arrivals == 2 and st.total_completions == 2


@with_cluster
async def test_replica_killed_mid_request_is_retried_elsewhere(cluster: Cluster) -> None:
    await cluster.add("m-stage-0")
    slow = await cluster.add("m-stage-1", delay_s=2.0)  # r2: picked first (listed first, both idle)
    await cluster.add("m-stage-1", delay_s=0.0)  # r3
    router = make_router(cluster)
    try:
        task = asyncio.create_task(router.invoke("m", b"x"))
        for _ in range(200):
            if slow.calls:
                break
            await asyncio.sleep(0.01)
        assert slow.calls == 1
        await cluster.kill("r2", unlist=False)  # dies while serving; still listed (as a stale replica list would)
        reply = await asyncio.wait_for(task, 5)
        assert reply.status == 200 and reply.body.endswith(b"|m-stage-1#3")
    finally:
        await router.close()


@with_cluster
async def test_killed_only_replica_gives_explicit_error(cluster: Cluster) -> None:
    await cluster.add("m-stage-0")
    slow = await cluster.add("m-stage-1", delay_s=2.0)
    router = make_router(cluster, request_timeout_s=3.0)
    try:
        task = asyncio.create_task(router.invoke("m", b"x"))
        while not slow.calls:
            await asyncio.sleep(0.01)
        await cluster.kill("r2", unlist=False)
        reply = await asyncio.wait_for(task, 6)
        assert reply.status in (502, 504)
        err = json.loads(reply.body)
        assert "m-stage-1" in err["error"]
    finally:
        await router.close()
    assert router.accepted == router.answered == 1


@with_cluster
async def test_replica_503_is_retried_and_4xx_and_500_are_passed_back(cluster: Cluster) -> None:
    """Issue 14 item 5: only what another replica can fix is retried (503: a draining or overloaded
    replica); a 4xx or a stage's 500 is the answer to this input, passed back once, never retried."""
    await cluster.add("m-stage-0", status=503)
    await cluster.add("m-stage-0")
    router = make_router(cluster, stages=1)
    try:
        ok = await router.invoke("m", b"x")
        assert ok.status == 200
        cluster.source.replicas["m-stage-0"] = cluster.source.replicas["m-stage-0"][:1]
        for status in (400, 500):
            cluster.fakes["r1"].status = status
            calls = cluster.fakes["r1"].calls
            bad = await router.invoke("m", b"x")
            assert bad.status == status and json.loads(bad.body)["error"] == "boom"
            assert cluster.fakes["r1"].calls == calls + 1  # tried once
    finally:
        await router.close()


@with_cluster
async def test_queue_cap_answers_429_with_retry_after(cluster: Cluster) -> None:
    await cluster.add("m-stage-0", delay_s=0.2)
    router = make_router(cluster, stages=1, queue_cap=2, retry_after_s=3)
    try:
        replies = await asyncio.gather(*(router.invoke("m", b"x") for _ in range(8)))
    finally:
        await router.close()
    codes = sorted(r.status for r in replies)
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and codes.count(200) + codes.count(429) == 8
    refused = next(r for r in replies if r.status == 429)
    assert refused.headers["Retry-After"] == "3"
    assert "cap" in json.loads(refused.body)["error"]


@with_cluster
async def test_no_replica_means_deadline_error_not_silence(cluster: Cluster) -> None:
    router = make_router(cluster, stages=1, request_timeout_s=0.3)
    try:
        reply = await asyncio.wait_for(router.invoke("m", b"x"), 3)
    finally:
        await router.close()
    assert reply.status == 504


@with_cluster
async def test_ten_thousand_requests_with_random_kills_all_answered(cluster: Cluster) -> None:
    rng = random.Random(1)
    for fn in ("m-stage-0", "m-stage-1"):
        for _ in range(3):
            await cluster.add(fn, delay_s=0.0)
    router = make_router(cluster, request_timeout_s=5.0, attempt_timeout_s=1.0, queue_cap=10_000)
    stop = asyncio.Event()
    kills = 0

    async def killer() -> None:
        nonlocal kills
        while not stop.is_set():
            await asyncio.sleep(0.05)
            fn = rng.choice(["m-stage-0", "m-stage-1"])
            victims = cluster.source.replicas[fn]
            if len(victims) > 1:
                victim = rng.choice(victims)
                await cluster.kill(victim.id, unlist=rng.random() < 0.5)  # half the time the list is stale
                kills += 1
                await cluster.add(fn)
                cluster.source.replicas[fn] = [r for r in cluster.source.replicas[fn] if r.id != victim.id]

    sem = asyncio.Semaphore(128)

    async def one(i: int):
        async with sem:
            return await router.invoke("m", str(i).encode())

    killer_task = asyncio.create_task(killer())
    try:
        replies = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(10_000))), 170)
    finally:
        stop.set()
        await killer_task
        await router.close()
    assert len(replies) == 10_000
    statuses = [r.status for r in replies]
    # every one answered: a success or an explicit error; a 429 with Retry-After is the router's overload answer when
    # it predicts a deadline cannot be met (a stall of the machine inflates its service estimate: seen once in CI)
    assert all(r.status in (200, 502, 504) or (r.status == 429 and "Retry-After" in r.headers) for r in replies), \
        Counter(statuses)
    assert statuses.count(200) >= 9_900
    assert router.accepted == router.answered == 10_000
    assert kills >= 5
    for i, r in enumerate(replies):
        if r.status == 200:
            assert r.body.startswith(f"{i}|m-stage-0#".encode())


@with_cluster
async def test_close_answers_queued_and_running_requests(cluster: Cluster) -> None:
    await cluster.add("m-stage-0", delay_s=2.0)
    router = make_router(cluster, stages=1)
    tasks = [asyncio.create_task(router.invoke("m", b"x")) for _ in range(3)]  # 1 running, 2 queued
    await asyncio.sleep(0.2)
    await router.close()
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 3)
    assert [r.status for r in replies] == [503, 503, 503]
    assert router.accepted == router.answered == 3
