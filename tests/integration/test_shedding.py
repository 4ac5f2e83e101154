"""Issue 31 item 2: an admitted pipeline call is answered within its deadline, or shed early with 429.

At 240 req/s with ``X-Quart-Timeout-Ms: 2000``, 79 % of the admitted calls were answered 504: entry
admission counted only each stage's own queue, and a queued call was looked at again only once its
deadline had passed. `quartctl bench chaos` measures the end-to-end figure (``overload_deadline``).
"""

from __future__ import annotations

import asyncio

import pytest
from quart_kernel.admission import StageLoad
from quart_kernel.shedding import SHED_HEADER, admit_pipeline, pipeline_wait_s, shed_queued
from support.router_cluster import Cluster, make_router, with_cluster


def test_the_wait_counts_every_call_ahead_that_will_reach_the_bottleneck():
    fast, slow = StageLoad(10, 4, 0.01), StageLoad(0, 1, 0.1)
    # 10 calls queued at the fast stage 0, 2 in service there: all 12 pass the slow stage first
    assert pipeline_wait_s([fast, slow], [2, 0]) == pytest.approx(1.2)
    assert pipeline_wait_s([fast, StageLoad(0, 0, 0.1)], [2, 0]) == pytest.approx(0.025)  # nobody serves: unknown


def test_entry_admission_refuses_what_the_pipeline_cannot_finish_in_time():
    fast, slow = StageLoad(10, 4, 0.01), StageLoad(0, 1, 0.1)
    late = admit_pipeline([fast, slow], [2, 0], 1.0, "a call")
    assert not late.admit and late.status == 429 and late.retry_after_s >= 1  # 1.2 + 0.11 s > 1 s
    assert admit_pipeline([fast, slow], [2, 0], 2.0, "a call").admit
    assert admit_pipeline([fast, slow], [2, 0], 0.0, "a call").admit  # no deadline
    floor = admit_pipeline([StageLoad(0, 1, 0.1, fastest_s=0.09)], [0], 0.05, "a call")
    assert not floor.admit and floor.status == 400  # shorter than it ever took: retrying would not help


def test_a_queued_call_is_kept_while_its_rest_fits_and_shed_once_it_cannot():
    rest = [StageLoad(0, 1, 0.2), StageLoad(3, 1, 0.1)]  # this stage, then one with 3 queued
    assert shed_queued(rest, 0.7, "r").admit  # 0.2 + 0.1 + 3 × 0.1 = 0.6 s
    shed = shed_queued(rest, 0.5, "r")
    assert not shed.admit and shed.status == 429 and shed.retry_after_s == 1 and "deadline" in shed.reason


@with_cluster
async def test_the_router_sheds_a_queued_call_that_became_too_late_instead_of_a_504(cluster: Cluster) -> None:
    first = await cluster.add("m-stage-0", delay_s=0.2)
    await cluster.add("m-stage-1", delay_s=0.2)
    router = make_router(cluster, admission_safety=1.0)
    await router.start()
    try:
        for _ in range(3):  # measured: about 0.2 s per stage
            assert (await router.invoke("m", b"x")).status == 200
        first.delay_s = 0.6  # slower than measured: both calls below are admitted on the old figure
        a = asyncio.create_task(router.invoke("m", b"a", timeout_s=0.9))
        await asyncio.sleep(0.01)
        b = asyncio.create_task(router.invoke("m", b"b", timeout_s=0.9))
        ra, rb = await a, await b
        assert ra.status == 200
        assert rb.status == 429 and rb.headers.get(SHED_HEADER) == "deadline" and int(rb.headers["Retry-After"]) >= 1
        assert first.calls == 4  # b never took a stage-0 replica
    finally:
        await router.close()


def test_a_proxied_call_is_shed_429_when_no_replica_frees_up_in_time(tmp_path):
    import time

    import requests
    from support.faas_cli import Running, busy_function

    running = Running(tmp_path)
    try:
        occupy = busy_function(running)
        assert requests.post(f"{running.url}/function/busy", data=b"x", timeout=10).status_code == 200  # measured
        occupy(1)  # its only replica is at its concurrency limit
        start = time.monotonic()
        res = requests.post(f"{running.url}/function/busy", data=b"x", headers={"X-Quart-Timeout-Ms": "400"},
                            timeout=10)
        took = time.monotonic() - start
        assert res.status_code == 429 and res.headers[SHED_HEADER] == "deadline" and res.headers["Retry-After"]
        assert took < 1.0, took  # shed when only its service time was left, not a 504 at the deadline
        occupy(-1)
    finally:
        running.close()
