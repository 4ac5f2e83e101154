"""The KeysManager daemon end to end: real processes, real fork, real HTTP on ephemeral ports.

Each test starts its own daemon (``python -m keysmanager.daemon``) with a private state dir and socket;
the fixture kills whatever is left, and checks that no shared-memory segment of that daemon remains.
Stages: parameter-free emulated stages (no model needed), and a tiny model made with the partitioner
for the tests that need real parameters (cpu compute, eviction, invalidation, isolated mode).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import requests
from support.keysmanager import (
    EMULATED,
    IDS,
    Daemon,
    daemons_in_temp_dir,
    emulated,
    gone,
    infer,
    raw_post,
    stage,
    wait_for,
    zygote_of,
)

from keysmanager.client import KeysManagerError
from keysmanager.types import StageSpec


@pytest.fixture(scope="module")
def shared():
    """One daemon for the tests that leave it running (each uses its own function names)."""
    with daemons_in_temp_dir() as (root, daemons, _):
        d = Daemon(root, "hs")
        daemons.append(d)
        yield d.start()


# --------------------------------------------------------------------------- API hygiene
def test_socket_is_private_and_bad_input_gets_clear_4xx_while_serving(shared, tmp_path):
    d = shared
    assert (d.socket.stat().st_mode & 0o777) == 0o600
    status, data = raw_post("/v1/replicas", b"{not json", d.socket)
    assert status == 400 and "not valid JSON" in data["error"] and data["field"] == "body"
    status, data = raw_post("/v1/cache", b"[1, 2]", d.socket)
    assert status == 400 and data["field"] == "spec"
    missing = StageSpec("ghost-stage-0", env={"QUART_MODEL_DIR": str(tmp_path / "nope"), "QUART_COMPUTE": "cpu"})
    with pytest.raises(KeysManagerError) as err:
        d.client.start(missing, 1)
    assert err.value.status == 404 and "unknown stage" in err.value.message
    with pytest.raises(KeysManagerError) as err:
        d.client.start(emulated(), -1)
    assert err.value.status == 400 and err.value.field == "count"
    with pytest.raises(KeysManagerError) as err:
        d.client.start(emulated(), 1, mode="shared-please")
    assert err.value.status == 400 and err.value.field == "mode"
    with pytest.raises(KeysManagerError) as err:
        d.client.start(emulated(), 1, source="disk-please")
    assert err.value.status == 400 and err.value.field == "source"
    with pytest.raises(KeysManagerError) as err:
        d.client.start(StageSpec("bad name!", env=EMULATED), 1)
    assert err.value.status == 400 and err.value.field == "spec.function"
    with pytest.raises(KeysManagerError) as err:
        d.client.start(emulated(QUART_COMPUTE="quantum"), 1)
    assert err.value.status == 400 and "QUART_COMPUTE" in err.value.message
    with pytest.raises(KeysManagerError) as err:
        d.client.stop("no-such-replica")
    assert err.value.status == 404
    # still serving: a good request works
    [rep] = d.client.start(emulated("api-stage-0"), 1)
    assert rep.state == "ready" and rep.source == "cold"
    assert requests.post(rep.url, json=IDS, timeout=30).status_code == 200


# --------------------------------------------------------------------------- fork path
def test_zygote_is_single_threaded_and_forked_replicas_serve_concurrent_requests(shared):
    d = shared
    spec = emulated("conc-stage-0")
    info = d.client.ensure_cached(spec)
    assert info["threads"] == 1, "a zygote must start no thread before fork"
    replicas = d.client.start(spec, 4)
    assert [r.source for r in replicas] == ["fork"] * 4
    assert all(r.state == "ready" and r.ready_ms is not None for r in replicas)
    assert len({r.port for r in replicas}) == 4 and len({r.pid for r in replicas}) == 4

    def hammer(url: str) -> list[int]:
        with requests.Session() as s:  # keep-alive: one connection, many requests
            return [s.post(url, json=IDS, timeout=20).status_code for _ in range(15)]

    with cf.ThreadPoolExecutor(12) as pool:  # 12 clients over 4 replicas: 3 concurrent per replica
        futures = [pool.submit(hammer, replicas[i % 4].url) for i in range(12)]
        codes = [c for f in cf.as_completed(futures, timeout=90) for c in f.result()]
    assert codes == [200] * 180
    zygote = zygote_of(d, spec.function)
    assert zygote.live_replicas == 4
    assert all(psutil.Process(r.pid).ppid() == zygote.pid for r in replicas)
    listed = {r.id: r for r in d.client.replicas(spec.function)}
    assert all(listed[r.id].rss_bytes > 0 for r in replicas)  # memory readings by default
    cheap = d.client.replicas(spec.function, memory=False)  # the gateway's frequent poll
    assert {r.id for r in cheap} == set(listed) and all(r.rss_bytes == 0 for r in cheap)
    # a function deployed without the cache: cold even though a zygote holds the stage, and nothing new cached
    [plain] = d.client.start(spec, 1, source="cold")
    assert plain.source == "cold" and plain.state == "ready" and psutil.Process(plain.pid).ppid() != zygote.pid
    assert requests.post(plain.url, json=IDS, timeout=30).status_code == 200


def test_stop_drains_in_flight_requests_and_frees_port(shared):
    d = shared
    slow = emulated("slow-stage-0", QUART_EMULATED_MEAN_MS="800")
    d.client.ensure_cached(slow)
    [rep] = d.client.start(slow, 1)
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, rep.url, json=IDS, timeout=30)
        time.sleep(0.5)  # the request is in service (or at least in the listen backlog)
        stopped = d.client.stop(rep.id, drain=True)
        assert pending.result().status_code == 200, "drain must answer the request in flight"
    assert stopped.state == "dead" and stopped.exit_status == 0
    assert gone(rep.pid)
    with pytest.raises(requests.ConnectionError):
        requests.post(rep.url, json=IDS, timeout=5)


# --------------------------------------------------------------------------- faults
def test_kill_9_of_a_replica_is_reported_dead_and_reaped(shared):
    d = shared
    spec = emulated("kill-stage-0")
    d.client.ensure_cached(spec)
    forked, other = d.client.start(spec, 2)
    zygote_pid = zygote_of(d, spec.function).pid
    os.kill(forked.pid, signal.SIGKILL)
    dead = wait_for(lambda: next((r for r in d.client.replicas() if r.id == forked.id and r.state == "dead"), None),
                    what="the killed replica reported dead")
    assert dead.exit_status == -signal.SIGKILL
    wait_for(lambda: not psutil.pid_exists(forked.pid), what="the killed replica reaped (no zombie)")
    assert all(c.status() != psutil.STATUS_ZOMBIE for c in psutil.Process(zygote_pid).children())
    assert requests.post(other.url, json=IDS, timeout=10).status_code == 200  # the sibling is untouched
    assert [r.id for r in d.client.replicas(spec.function) if r.state != "dead"] == [other.id]


def test_killing_the_keysmanager_leaves_no_orphans_and_a_restart_cleans_up(daemon, km_root):
    _, _, pids = km_root
    d = daemon("h1")
    d.client.ensure_cached(emulated())
    forked = d.client.start(emulated(), 2)
    [cold] = d.client.start(emulated("cold-stage-0"), 1, cache=False)
    [survivor] = d.client.start(emulated(), 1, survive=True)
    pids.append(survivor.pid)
    zygote = d.client.zygotes()[0]
    assert cold.source == "cold" and survivor.source == "fork"
    d.kill(signal.SIGKILL)
    for pid in [zygote.pid, cold.pid] + [r.pid for r in forked]:
        wait_for(lambda pid=pid: gone(pid), timeout=10, what=f"pid {pid} to exit with its KeysManager")
    assert requests.post(survivor.url, json=IDS, timeout=10).status_code == 200  # told to survive
    # a new KeysManager on the same state dir adopts the survivor and removes leftovers
    Path("/dev/shm", d.shm_prefix + "leftover-1").write_bytes(b"x" * 4096)
    d2 = daemon("h1")
    health = d2.client.health()
    assert survivor.pid in health["recovered"]["adopted"]
    assert any("leftover-1" in p for p in health["recovered"]["removed_shm"])
    assert d.shm_files() == []
    [adopted] = [r for r in d2.client.replicas() if r.id == survivor.id]
    assert adopted.state == "ready"
    stopped = d2.client.stop(survivor.id)
    assert stopped.state == "dead" and gone(survivor.pid)


def test_a_second_keysmanager_on_the_same_state_dir_is_refused(shared):
    d = shared
    clash = subprocess.run([sys.executable, "-m", "keysmanager.daemon", *d.args], capture_output=True, text=True,
                           timeout=60)
    assert clash.returncode == 2 and "another KeysManager" in clash.stderr
    assert d.client.health()["pid"] == d.proc.pid


def test_shutdown_stops_replicas_and_removes_segments(daemon):
    d = daemon("h3")
    d.client.ensure_cached(emulated())
    reps = d.client.start(emulated(), 2)
    d.kill(signal.SIGTERM)
    assert d.proc.returncode == 0
    assert all(gone(r.pid) for r in reps)
    assert d.shm_files() == [] and not d.socket.exists()


def test_gpu_slots_are_counted_and_refused_when_full(daemon):
    d = daemon("h4", "--gpus", "2")
    d.client.ensure_cached(emulated())
    reps = d.client.start(emulated(), 2)
    assert sorted(r.gpu_slot for r in reps) == [0, 1]
    report = d.client.report()
    assert (report.gpu_slots, report.gpu_used, report.gpu_free) == (2, 2, 0)
    with pytest.raises(KeysManagerError) as err:
        d.client.start(emulated(), 1)
    assert err.value.status == 409
    d.client.stop(reps[0].id)
    assert d.client.report().gpu_used == 1


# --------------------------------------------------------------------------- stages with real parameters
@pytest.fixture(scope="module")
def models():
    """Two partitioned models with random weights: `tiny` (2 stages) and a 1-stage ~16 MB model."""
    from quart_tools.partition import partition, stage_size_config

    root = Path(tempfile.mkdtemp(prefix="km-models-", dir="/tmp"))
    try:
        partition("tiny", 2, str(root / "tiny"), weights="random", progress=False)
        partition(stage_size_config(16, stages=1), 1, str(root / "mid"), weights="random", progress=False,
                  name="mid")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def segment_smaps(pid: int, shm_path: str) -> dict[str, int]:
    """Summed smaps fields (kB) of the mappings of one parameter segment in process ``pid``."""
    totals: dict[str, int] = {}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                inside = len(head) >= 6 and head[5] == shm_path
            elif inside and line.rstrip().endswith("kB"):
                totals[head[0].rstrip(":")] = totals.get(head[0].rstrip(":"), 0) + int(head[1])
    return totals


def test_forked_replicas_answer_like_a_cold_one_while_others_serve_load(shared, models):
    d = shared
    spec = stage(models / "tiny", 0)
    d.client.ensure_cached(spec)
    busy = d.client.start(spec, 2)
    stop_load = False

    def load(url: str) -> int:
        n = 0
        with requests.Session() as s:
            while not stop_load:
                assert s.post(url, json={"input_ids": [[5, 6, 7]]}, timeout=30).status_code == 200
                n += 1
        return n

    with cf.ThreadPoolExecutor(4) as pool:
        loaders = [pool.submit(load, r.url) for r in busy for _ in range(2)]
        time.sleep(0.3)
        forked = d.client.start(spec, 2)  # forked while the zygote's other children serve load
        [cold] = d.client.start(stage(models / "tiny", 0, function="tiny-cold-stage-0"), 1, cache=False)
        assert [r.source for r in forked] == ["fork", "fork"] and cold.source == "cold"
        reference = infer(cold.url)
        outputs = [infer(r.url) for r in forked + busy]
        stop_load = True
        served = [f.result(timeout=60) for f in loaders]
    assert all(o == reference for o in outputs), "a forked replica must compute exactly what a cold one does"
    assert all(n > 0 for n in served)
    assert len(reference) > 1000  # a real safetensors activation, not an error document


def test_lru_eviction_under_a_low_limit_never_kills_a_serving_replica(daemon, models):
    tiny = models / "tiny"
    one = json.loads((tiny / "manifest.json").read_text())["stages"][1]["file_bytes"]
    d = daemon("h5", "--memory-limit", str(int(2.5 * one)))  # room for two tiny stages
    a, b, c, e = (stage(tiny, i % 2, function=f"{n}-stage-{i % 2}") for i, n in enumerate("abce"))
    d.client.ensure_cached(a)
    [serving] = d.client.start(a, 1)
    d.client.ensure_cached(b)
    d.client.ensure_cached(b)  # b is now more recent than a
    d.client.ensure_cached(c)  # evicts b: a is older, but a still has a live replica, so it goes last
    assert d.client.report().cached == ["a-stage-0", "c-stage-0"]
    d.client.ensure_cached(a)
    d.client.ensure_cached(e)  # all idle but a: c is the least recently used
    assert d.client.report().cached == ["a-stage-0", "e-stage-1"]
    report = d.client.report()
    assert report.memory_used <= report.memory_limit
    # the replica of a outlives its zygote: invalidate a, it keeps serving; its segment is still counted
    assert d.client.invalidate("a-stage-0")["dropped"] is True
    assert requests.post(serving.url, json=IDS, timeout=30).status_code == 200
    assert [r.state for r in d.client.replicas("a-stage-0")] == ["ready"]
    assert d.client.report().memory_used >= 1.9 * one  # segments hold the tensors without the file header
    d.client.stop(serving.id)
    wait_for(lambda: d.client.report().memory_used < 1.1 * one, what="the last mapping of a's segment released")
    assert len(d.shm_files()) == 1  # e's segment only: every dropped segment's file is gone


def test_invalidation_after_a_checkpoint_change(shared, models, tmp_path):
    from quart_tools.partition import partition

    model = tmp_path / "tiny"
    shutil.copytree(models / "tiny", model)
    d = shared
    spec = stage(model, 0, function="inv-stage-0")
    old_sha = d.client.ensure_cached(spec)["sha256"]
    [old] = d.client.start(spec, 1)
    before = infer(old.url)
    partition("tiny", 2, str(model), weights="random", seed=7, progress=False)  # new weights, new sha256
    wait_for(lambda: zygote_of(d, spec.function) is None, timeout=10, what="the stale zygote dropped")
    [new] = d.client.start(spec, 1)  # nothing cached: cold from the new checkpoint, and it caches again
    after = infer(new.url)
    assert after != before
    assert infer(old.url) == before  # a serving replica is never killed by invalidation
    zygote = wait_for(lambda: zygote_of(d, spec.function), timeout=60, what="the new zygote")
    assert zygote.sha256 != old_sha
    [forked] = d.client.start(spec, 1)
    assert forked.source == "fork" and infer(forked.url) == after


def test_copy_on_write_shares_parameter_pages_and_isolated_mode_copies_them(shared, models):
    d = shared
    spec = stage(models / "mid", 0)
    info = d.client.ensure_cached(spec)
    seg_kb = info["param_bytes"] // 1024
    assert seg_kb > 10_000
    cow = d.client.start(spec, 2)
    [iso] = d.client.start(spec, 1, mode="isolated")
    for r in cow + [iso]:
        infer(r.url, ids={"input_ids": [[1, 2]]})  # touches every weight
    for r in cow:
        m = segment_smaps(r.pid, info["shm_path"])
        assert m["Anonymous"] < 0.02 * seg_kb, "a copy-on-write replica must not copy parameter pages"
        assert m["Rss"] > 0.9 * seg_kb and m["Pss"] < 0.6 * seg_kb  # mapped, and shared with the other
    m = segment_smaps(iso.pid, info["shm_path"])
    assert m["Anonymous"] > 0.95 * seg_kb, "isolated mode must hold a private copy of every page"
    assert m["Pss"] > 0.95 * seg_kb
    assert d.client.report().memory_used >= 2 * info["param_bytes"]  # segment + the isolated copy


def test_async_client_speaks_the_same_api(shared):
    import asyncio

    from keysmanager.client import AsyncKeysManagerClient

    async def scenario() -> None:
        km = AsyncKeysManagerClient(str(shared.socket), timeout=120)
        try:
            spec = emulated("async-stage-0")
            await km.ensure_cached(spec)
            [rep] = await km.start(spec, 1, wait=False)
            assert rep.state == "starting" and rep.source == "fork"
            ready = await asyncio.wait_for(_until_ready(km, rep.id), 30)
            assert ready.ready_ms is not None
            assert "async-stage-0" in (await km.report()).cached
            assert (await km.stop(rep.id)).state == "dead"
            try:
                await km.start(spec, -3)
            except KeysManagerError as exc:
                assert exc.status == 400 and exc.field == "count"
            else:
                raise AssertionError("a negative count must be refused")
        finally:
            await km.close()

    async def _until_ready(km, rid):
        while True:
            [r] = [r for r in await km.replicas("async-stage-0") if r.id == rid]
            if r.state == "ready":
                return r
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
