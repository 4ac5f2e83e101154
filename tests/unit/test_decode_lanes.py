"""The gateway's decode lanes (gateway_plugin.generation.decodebatch): every waiting decode step goes in the next
batch up to the limit, prefill chunks alternate with batches (the stall bound), a session that leaves while
queued leaves the queue, a failed batch call fails each of its sessions, a free lane holds (bounded) for the steps
on their way so the sessions move through the stages as one batch; the label and settings are validated."""

from __future__ import annotations

import asyncio

import pytest
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.decodebatch import (
    ReplicaLane,
    batch_answers,
    batch_request,
    hold_for,
    token_row,
)
from quart_stage import batchwire
from quart_stage.errors import QuartError
from quart_stage.labels import StageLabels
from quart_stage.settings import ConfigError


class Stage:
    """A fake replica behind a lane: records what ran, in order; each call takes ``delay_s``."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.log: list[str] = []
        self.delay_s = delay_s
        self.fail = False

    async def send(self, jobs):
        self.log.append(f"batch{len(jobs)}")
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("connection refused")
        return [({"id": j.entry.id, "status": 200, "pos": j.entry.pos + 1}, None) for j in jobs]

    def chunk(self, name: str):
        async def call():
            self.log.append(name)
            await asyncio.sleep(self.delay_s)
            return name
        return call


def _step(lane: ReplicaLane, sid: str, pos: int = 5):
    return asyncio.ensure_future(lane.decode(batchwire.BatchEntry(sid, pos), token_row(7)))


def test_waiting_decode_steps_go_as_one_batch_up_to_the_limit():
    async def run():
        stage = Stage()
        lane = ReplicaLane(1, 4, stage.send)
        tasks = [_step(lane, f"s{i}") for i in range(7)]
        answers = await asyncio.gather(*tasks)
        return stage.log, answers

    log, answers = asyncio.run(run())
    assert log == ["batch1", "batch4", "batch2"]  # the first alone (the replica was free), then what waited
    assert [a[0]["id"] for a in answers] == [f"s{i}" for i in range(7)]


def test_prefill_chunks_alternate_with_decode_batches():
    async def run():
        stage = Stage()
        lane = ReplicaLane(1, 16, stage.send)
        first = _step(lane, "s0")
        chunks = [asyncio.ensure_future(lane.solo(stage.chunk(f"chunk{k}"))) for k in range(3)]
        await asyncio.sleep(0)
        steps = [_step(lane, f"s{i}") for i in range(1, 4)]
        await asyncio.gather(first, *chunks, *steps)
        more = [_step(lane, f"t{i}") for i in range(2)]
        await asyncio.gather(*more)
        return stage.log

    # each decode batch waits for at most one chunk: chunk, batch, chunk, ... never two chunks in a row while
    # decode steps wait
    assert asyncio.run(run()) == ["batch1", "chunk0", "batch3", "chunk1", "chunk2", "batch1", "batch1"]


def test_a_session_that_leaves_while_queued_leaves_the_queue_and_a_failed_call_fails_each():
    async def run():
        stage = Stage(delay_s=0.05)
        lane = ReplicaLane(1, 16, stage.send)
        busy = _step(lane, "s0")
        gone = _step(lane, "gone")
        stay = _step(lane, "stay")
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(busy, stay)
        stage.fail = True
        failed = await asyncio.gather(_step(lane, "a"), _step(lane, "b"), return_exceptions=True)
        return stage.log, failed

    log, failed = asyncio.run(run())
    assert log[:2] == ["batch1", "batch1"]  # "stay" went alone: "gone" left the queue, it never reached the stage
    assert all(isinstance(f, RuntimeError) for f in failed)


def test_hold_for_waits_only_for_steps_on_their_way_and_within_the_bound():
    assert hold_for(waiting=3, coming=2, max_batch=16, waited_s=0.01, hold_s=0.1) == pytest.approx(0.09)
    assert hold_for(waiting=3, coming=0, max_batch=16, waited_s=0.0, hold_s=0.1) == 0  # nothing else coming
    assert hold_for(waiting=4, coming=2, max_batch=4, waited_s=0.0, hold_s=0.1) == 0  # the batch is full
    assert hold_for(waiting=3, coming=2, max_batch=16, waited_s=0.1, hold_s=0.1) == 0  # waited the bound
    assert hold_for(waiting=3, coming=2, max_batch=16, waited_s=0.0, hold_s=0.0) == 0  # hold off


async def _sessions_through(lanes: list[ReplicaLane], count: int, steps: int, start_gap_s: float) -> None:
    """``count`` sessions, started ``start_gap_s`` apart, each running ``steps`` decode steps through the lanes."""
    async def session(sid: str, delay: float) -> None:
        await asyncio.sleep(delay)
        for pos in range(steps):
            for lane in lanes:
                await lane.decode(batchwire.BatchEntry(sid, pos, pos == steps - 1), token_row(pos))
            await asyncio.sleep(0)  # the gateway between tokens

    await asyncio.gather(*(session(f"s{i}", i * start_gap_s) for i in range(count)))


def _pipeline_batches(hold_s: float) -> list[list[str]]:
    async def run():
        stages = [Stage(delay_s=0.01) for _ in range(3)]
        lanes = [ReplicaLane(1, 16, stage.send, hold_s) for stage in stages]
        await _sessions_through(lanes, 6, 12, start_gap_s=0.004)
        return [stage.log for stage in stages]
    return asyncio.run(run())


def test_holding_for_the_group_moves_the_sessions_through_the_stages_as_one_batch():
    held = _pipeline_batches(hold_s=0.2)
    # sessions arriving scattered are gathered: after the first rounds every stage runs all six at once
    # (s0's first step went alone: nothing else was decoding yet; it ends one step before the others)
    assert held == [["batch1"] + ["batch6"] * 11 + ["batch5"]] * 3, held
    scattered = _pipeline_batches(hold_s=0.0)  # without the hold they stay split over the pipelined stages
    assert all(len(log) > 2 * 13 for log in scattered), scattered


def test_the_hold_is_bounded_and_ends_when_the_awaited_session_leaves():
    async def run():
        stage = Stage(delay_s=0.0)
        lane = ReplicaLane(1, 16, stage.send, hold_s=0.15)
        await _step(lane, "away")  # a member: the lane expects its next step
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await _step(lane, "a")  # "away" never comes: "a" goes after the bound
        bounded = loop.time() - t0
        t0 = loop.time()
        waiting = _step(lane, "a", pos=6)
        await asyncio.sleep(0.02)
        lane.leave("away")  # "away" ended: nothing else is coming, "a" goes at once
        await waiting
        released = loop.time() - t0
        await lane.decode(batchwire.BatchEntry("a", 7, True), token_row(1))  # its last step: no longer awaited
        t0 = loop.time()
        lane.leave("away")
        await _step(lane, "b")
        return bounded, released, loop.time() - t0, lane.members

    bounded, released, alone, members = asyncio.run(run())
    assert 0.14 <= bounded < 0.5 and 0.015 <= released < 0.1 and alone < 0.05  # "b": the only member left
    assert set(members) == {"b"}


class Compute(Stage):
    """A fake replica whose batched step costs ``per_row_s`` a session (compute-bound); logs each batch's ids."""

    def __init__(self, per_row_s: float) -> None:
        super().__init__()
        self.per_row_s = per_row_s

    async def send(self, jobs):
        self.log.append(sorted(j.entry.id for j in jobs))
        await asyncio.sleep(self.per_row_s * len(jobs))
        return [({"id": j.entry.id, "status": 200, "pos": j.entry.pos + 1}, None) for j in jobs]


def _micro_batched(groups: int) -> tuple[float, list[list[list[str]]]]:
    """Six sessions through three compute-bound stages, dealt into ``groups`` micro-batches: (seconds, batches)."""
    async def run():
        stages = [Compute(per_row_s=0.005) for _ in range(3)]
        lanes = [ReplicaLane(1, 16, stage.send, hold_s=0.2) for stage in stages]

        async def session(i: int) -> None:
            for pos in range(10):
                for lane in lanes:
                    await lane.decode(batchwire.BatchEntry(f"s{i}", pos, pos == 9), token_row(pos), i % groups)
                await asyncio.sleep(0)

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(*(session(i) for i in range(6)))
        return loop.time() - t0, [stage.log for stage in stages]
    return asyncio.run(run())


def test_micro_batch_groups_keep_every_stage_busy_and_never_mix():
    lockstep, _ = _micro_batched(groups=1)
    piped, batches = _micro_batched(groups=3)
    group_of = {f"s{i}": i % 3 for i in range(6)}
    for log in batches:  # a batch is one group's steps, and its groups' members go together after the first
        assert all(len({group_of[sid] for sid in batch}) == 1 for batch in log), log
        assert sum(len(batch) == 2 for batch in log) >= 25, log
    # three stages computing three groups at once, against one batch crossing the idle stages in turn
    assert piped < 0.65 * lockstep, (piped, lockstep)


def test_the_batch_wire_round_trips_without_torch():
    jobs = [type("J", (), {"entry": batchwire.BatchEntry(f"s{i}", 3 + i, i == 1, {"seed": 2} if i else {}),
                           "row": token_row(10 + i)})() for i in range(3)]
    body, headers = batch_request(0, "m", jobs)
    rows, dtype, shape, meta = batchwire.split_rows(body, "input_ids")
    assert headers[batchwire.H_SESSION_BATCH] == "3" and dtype == "I64" and shape == [1]
    assert [int.from_bytes(r, "little") for r in rows] == [10, 11, 12]
    table = batchwire.parse_table(meta[batchwire.META_SESSIONS], 3)
    assert table == [j.entry for j in jobs]
    answer = b'{"results": [{"id": "s0", "status": 200, "token": 4, "pos": 4}, {"id": "s1", "status": 409, "held": 0}' \
             b', {"id": "s2", "status": 200, "token": 9, "pos": 6}]}'
    got = batch_answers(jobs, answer, last=True)
    assert [r["status"] for r, _ in got] == [200, 409, 200] and got[2][0]["token"] == 9
    with pytest.raises(ValueError):
        batch_answers(jobs[:2], answer, last=True)


@pytest.mark.parametrize("value", ["0", "257", "x"])
def test_the_decode_batch_label_is_validated(value):
    with pytest.raises(QuartError) as err:
        StageLabels.parse({"com.quart.batch.decode-max": value})
    assert err.value.status == 400 and err.value.field == "labels.com.quart.batch.decode-max"
    assert StageLabels.parse({"com.quart.batch.decode-max": "16"}).decode_batch == 16


def test_the_decode_batch_settings_are_validated():
    assert GenerationConfig.from_env({"QUART_GEN_DECODE_BATCH_MAX": "32"}).decode_batch_max == 32
    for env in ({"QUART_GEN_DECODE_BATCH_MAX": "0"}, {"QUART_GEN_DECODE_BATCH_MAX": "1000"},
                {"QUART_GEN_PREFILL_CHUNK": "-1"}, {"QUART_GEN_DECODE_HOLD_MS": "-5"}):
        with pytest.raises(ConfigError):
            GenerationConfig.from_env(env)
