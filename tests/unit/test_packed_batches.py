"""Packed one-shot batches (quart_stage.ragged.Segments, gateway_plugin.batching.pack/split; docs/batching.md
#packed-batches): requests of different lengths laid end to end in one row, no padding, give each request's
outputs of a run alone (fp32, max |diff| ≤ 1e-4) for every family the stage runtime supports — BERT (masked-LM
head), sentence BERT (pooled head), LLaMA, Mistral and Qwen2 with sliding windows shorter than the prompts, and
OPT — through the router's pack and split and every stage's wire, validation and forward; a malformed
``segment_lengths`` is a 400 naming it."""

from __future__ import annotations

import json

import pytest
import torch
from gateway_plugin.batching import member_of, pack, packable, split
from quart_stage import wire
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_tools.partition import partition
from support.tiny_families import DECODER_CONFIGS, TINY_BASE

CONFIGS = {
    "bert": dict(model_type="bert", **TINY_BASE),
    "bert-sentence": dict(model_type="bert", quart_plan="bert-sentence", **TINY_BASE),
    **DECODER_CONFIGS,
}
LENGTHS = (9, 2, 14, 6, 1, 11)


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    out = {}
    for family, cfg in CONFIGS.items():
        out[family] = str(root / family)
        partition({**cfg, "_name": family}, 3, out[family], progress=False, seed=11, std=0.5)
    return out


def _runtimes(d: str) -> list[StageRuntime]:
    n = len(json.loads(open(f"{d}/manifest.json").read())["stages"])
    return [StageRuntime.load(StageConfig(model_dir=d, stage_index=i)) for i in range(n)]


def _through(runtime: StageRuntime, body: bytes) -> bytes:
    resp = runtime.handle(body, {"Content-Type": wire.CONTENT_TYPE, "Accept": wire.CONTENT_TYPE})
    assert resp.status == 200, resp.body
    return resp.body


def _output(body: bytes) -> torch.Tensor:
    tensors = dict(wire.decode(body).tensors)
    assert "segment_lengths" not in tensors
    (name,) = [n for n in tensors if n != "attention_mask"]
    return tensors[name]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_batches_give_each_request_its_output_alone(models, family):
    runtimes = _runtimes(models[family])
    alone = [wire.encode_bytes({"input_ids": _ids(n)}, {}) for n in LENGTHS]
    members = [member_of(b, wire.CONTENT_TYPE) for b in alone]
    assert packable(members)
    ids = [f"r{k}" for k in range(len(LENGTHS))]
    bodies = alone
    expected = alone
    for rt in runtimes:  # each stage: the batch packed by the router, split back, as the router does
        expected = [_through(rt, b) for b in expected]
        members = [member_of(b, wire.CONTENT_TYPE) for b in bodies]
        packed = pack(members, {})
        assert "attention_mask" not in dict(wire.decode(packed).tensors)
        bodies = split(_through(rt, packed), members, ids)
    for got, want, n in zip(bodies, expected, LENGTHS, strict=True):
        got, want = _output(got), _output(want)
        assert got.shape == want.shape and (family == "bert-sentence" or got.shape[1] == n)
        assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("lengths", "why"), [([3, 3], "sum"), ([0, 7], "≥ 1"), ([[7]], "rank 1")])
def test_a_malformed_segment_lengths_is_a_400_naming_it(models, lengths, why):
    rt = _runtimes(models["llama"])[0]
    body = wire.encode_bytes({"input_ids": _ids(7), "segment_lengths": torch.tensor(lengths)}, {})
    resp = rt.handle(body, {"Content-Type": wire.CONTENT_TYPE})
    assert resp.status == 400
    error = json.loads(resp.body)
    assert error["field"] == "segment_lengths" and why in error["error"]


def test_requests_with_several_rows_or_their_own_mask_are_padded():
    rows = member_of(wire.encode_bytes({"input_ids": torch.ones((2, 5), dtype=torch.int64)}, {}), wire.CONTENT_TYPE)
    one = member_of(wire.encode_bytes({"input_ids": _ids(3)}, {}), wire.CONTENT_TYPE)
    assert not packable([rows, one])
    assert "attention_mask" in dict(wire.decode(pack([rows, one], {})).tensors)


def test_a_waiting_requests_body_is_parsed_once_per_stage(monkeypatch):
    """Every batch formed while a request waits looks at it; its body is decoded once, again only at its next stage."""
    from gateway_plugin import batching
    from gateway_plugin.router import Job

    calls = []
    real = batching.member_of
    monkeypatch.setattr(batching, "member_of", lambda body, ctype: calls.append(body) or real(body, ctype))
    body = wire.encode_bytes({"hidden_states": torch.ones((1, 3, 4))})
    job = Job(id="a", model="m", stages=["s0", "s1"], body=body, content_type="application/octet-stream",
              arrival=0.0, deadline=1.0, future=None)
    first = batching.member_for(job)
    assert batching.member_for(job) is first and first.length == 3 and len(calls) == 1
    job.body = wire.encode_bytes({"hidden_states": torch.ones((1, 5, 4))})  # its next stage's input
    assert batching.member_for(job).length == 5 and len(calls) == 2
    job.body = b"not safetensors"
    assert batching.member_for(job) is None and batching.member_for(job) is None and len(calls) == 3
