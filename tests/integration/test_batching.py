"""Dynamic batching at the router's stage queues (gateway_plugin.batching, docs/batching.md): requests of
different lengths batched through real tiny stages give the outputs they get one at a time (fp32, 1e-4), a
request the stage refuses keeps its error to itself, the service time by batch size is measured, and the
label is read."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from gateway_plugin.batching import BatchLimits, Member, limits_from_labels, pack, split
from gateway_plugin.config import PluginConfig
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.router import Router, StaticReplica, StaticReplicas
from gateway_plugin.snapshot_builder import StageState, build_snapshot
from quart_stage import wire
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_tools.partition import partition
from support.stage_server import StageServer

FAMILIES = {"decoder": "tiny", "encoder": "tiny-encoder", "pooled": "minilm"}  # minilm: real weights, mean pooling
TOL = 1e-4
STAGES = 2


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching")
    out = {}
    for family, preset in FAMILIES.items():
        partition(preset, STAGES, str(root / family), progress=False, seed=3)
        out[family] = str(root / family)
    return out


async def _pipeline(model_dir: str, batch_max: int) -> tuple[Router, list[StageServer]]:
    servers = []
    source = StaticReplicas()
    for i in range(STAGES):
        rt = StageRuntime.load(StageConfig(model_dir=model_dir, stage_index=i, num_stages=STAGES, threads=1))
        server = await StageServer(rt, delay_s=0.05).start()
        servers.append(server)
        source.replicas[f"m-{i}"] = [StaticReplica(f"r{i}", server.url)]
    model = _manifest(model_dir)["model"]
    router = Router(source, lambda: {model: [f"m-{i}" for i in range(STAGES)]}, PluginConfig(),
                    MetricsCollector(10.0), dispatch_poll_s=0.005,
                    batch_limits=lambda fn: BatchLimits(batch_max))
    return router, servers


def _requests(vocab: int, bad: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Eight requests of different lengths; one of two rows with its own mask; ``bad``: an id out of the vocab."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for k, length in enumerate((5, 9, 3, 12, 7, 7, 4, 10)):
        rows = 2 if k == 3 else 1
        tensors = {"input_ids": torch.randint(0, vocab, (rows, length), generator=gen)}
        if k == 3:
            tensors["attention_mask"] = torch.tensor([[1] * length, [1] * (length - 4) + [0] * 4])
        if k == bad:
            tensors["input_ids"][0, 1] = vocab + 5
        out.append(tensors)
    return out


async def _run(model_dir: str, batch_max: int, bodies: list[bytes]) -> tuple[list, list[list[int]], Router]:
    router, servers = await _pipeline(model_dir, batch_max)
    try:
        model = _manifest(model_dir)["model"]
        answers = await asyncio.gather(*(router.invoke(model, b) for b in bodies))
    finally:
        await router.close()
        for s in servers:
            await s.runner.cleanup()
    return answers, [s.rows for s in servers], router


def _manifest(model_dir: str) -> dict:
    with open(f"{model_dir}/manifest.json") as f:
        return json.load(f)


def _vocab(model_dir: str) -> int:
    return _manifest(model_dir)["config"]["vocab_size"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_outputs_equal_one_at_a_time(parts, family):
    bodies = [wire.encode_bytes(t) for t in _requests(_vocab(parts[family]))]
    alone, alone_rows, _ = asyncio.run(_run(parts[family], 1, bodies))
    batched, batched_rows, router = asyncio.run(_run(parts[family], 8, bodies))
    assert all(r == 1 or r == 2 for rows in alone_rows for r in rows)  # one request per call
    assert max(batched_rows[0]) >= 4, batched_rows  # the seven behind the first went as one batch
    worst = 0.0
    for a, b in zip(alone, batched, strict=True):
        assert a.status == 200 and b.status == 200, (a.body, b.body)
        x, y = wire.decode(a.body).tensors, wire.decode(b.body).tensors
        assert x.keys() == y.keys() and x["logits"].shape == y["logits"].shape
        worst = max(worst, (x["logits"] - y["logits"]).abs().max().item())
    print(f"{family}: max |diff| batched vs alone {worst:.3g}")
    assert worst <= TOL, f"max |diff| {worst:.3g}"  # a batched matmul may sum in another order
    sizes = dict((size, n) for size, n, _ in router.collector.stage("m-0").batch_service_s())
    assert sizes.get(1) and max(sizes) >= 4 and sum(size * n for size, n in sizes.items()) == len(bodies)
    last = dict((size, n) for size, n, _ in router.collector.stage(f"m-{STAGES - 1}").batch_service_s())
    assert max(last) >= 2 and sum(size * n for size, n in last.items()) == len(bodies)  # split there too, no re-run


def test_a_refused_request_keeps_its_error_to_itself(parts):
    d = parts["encoder"]
    requests = _requests(_vocab(d), bad=5)
    answers, rows, _ = asyncio.run(_run(d, 8, [wire.encode_bytes(t) for t in requests]))
    assert [a.status for a in answers] == [200] * 5 + [400] + [200] * 2
    assert "input_ids" in json.loads(answers[5].body)["field"]
    assert max(rows[0]) >= 4  # the batch was tried, refused, and its requests run one at a time
    assert answers[3].status == 200 and wire.decode(answers[3].body).tensors["logits"].shape[0] == 2


def test_pack_pads_right_and_split_gives_each_its_own():
    a = Member({"hidden": torch.arange(6.0).reshape(1, 3, 2)}, None, 1, 3)
    b = Member({"hidden": -torch.arange(10.0).reshape(1, 5, 2)}, torch.tensor([[1, 1, 1, 1, 0]]), 1, 5)
    body = pack([a, b], {"model": "m", "stage": "1"})
    packed = wire.decode(body).tensors
    assert packed["hidden"].shape == (2, 5, 2) and packed["hidden"][0, 3:].abs().sum() == 0
    assert packed["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    first, second = split(body, [a, b], ["ra", "rb"])
    one, two = wire.decode(first), wire.decode(second)
    assert torch.equal(one.tensors["hidden"], a.tensors["hidden"]) and "attention_mask" not in one.tensors
    assert torch.equal(two.tensors["attention_mask"], b.mask) and one.metadata["request_id"] == "ra"
    pooled = split(wire.encode_bytes({"logits": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
                                      "attention_mask": packed["attention_mask"]}), [a, b], ["ra", "rb"])
    assert [wire.decode(p).tensors["logits"].tolist() for p in pooled] == [[[1.0, 2.0]], [[3.0, 4.0]]]
    with pytest.raises(ValueError):
        split(wire.encode_bytes({"hidden": torch.zeros(1, 5, 2)}), [a, b], ["ra", "rb"])


def test_service_time_by_batch_size_reaches_the_snapshot():
    collector = MetricsCollector(10.0)
    m = collector.stage("f")
    for size, seconds in ((1, 0.010), (1, 0.012), (4, 0.020)):
        m.on_batch(size, seconds)
    assert m.batch_service_s() == ((1, 2, pytest.approx(0.011)), (4, 1, pytest.approx(0.020)))

    class Platform:  # the inventory and the queue view build_snapshot reads
        def stage_state(self, fn: str) -> StageState:
            return StageState(ready=1, desired=1)

        def queue_len(self, fn: str) -> int:
            return 0

        def busy(self, fn: str) -> int:
            return 0

    snap = build_snapshot(1.0, "m", ["f"], Platform(), Platform(), collector, 2.0)
    assert snap.stages[0].batch_service_s == m.batch_service_s()


def test_batch_labels():
    default = BatchLimits(1, 0.0)
    assert limits_from_labels({}, default) == default
    assert limits_from_labels({"com.quart.batch.max": "16", "com.quart.batch.wait-ms": "2"}, default) == \
        BatchLimits(16, 0.002)
    assert limits_from_labels({"com.quart.batch.max": "0"}, default) == default  # malformed: the default
