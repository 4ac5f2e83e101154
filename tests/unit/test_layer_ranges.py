"""Layer-range execution (``X-Quart-Layers``): a stage run as consecutive sub-ranges equals the whole stage
exactly (fp32) and the whole model, for every family, padded batches too; header validation; emulated time
scales with the range's share of parameters."""

from __future__ import annotations

import json

import pytest
import torch
from quart_stage import wire
from quart_stage.config import StageConfig
from quart_stage.layers import parse_layers, range_share
from quart_stage.manifest import Manifest
from quart_stage.runtime import StageRuntime
from quart_stage.verify import reference_model
from quart_tools.partition import partition

_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=128,
             max_position_embeddings=64)
CONFIGS = {
    "llama": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True, **_BASE),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=4, **_BASE),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, **_BASE),
    "opt": dict(model_type="opt", ffn_dim=64, word_embed_proj_dim=32,
                **{k: v for k, v in _BASE.items() if k != "intermediate_size"}),
    "bert": dict(model_type="bert", **_BASE),
}
IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
MASK = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranges")
    out = {}
    for family, config in CONFIGS.items():
        for n in (1, 2):
            d = root / f"{family}-{n}"
            partition({**config, "_name": family}, n, str(d), progress=False, seed=11, std=0.2)
            out[family, n] = str(d)
    return out


def _run(rt: StageRuntime, body: bytes, span: tuple[int, int] | None) -> bytes:
    headers = {"Content-Type": wire.CONTENT_TYPE}
    if span is not None:
        headers["X-Quart-Layers"] = f"{span[0]}-{span[1]}"
    resp = rt.handle(body, headers)
    assert resp.status == 200, resp.body
    held = rt.stage_range
    assert resp.headers["X-Quart-Layers-Held"] == f"{held[0]}-{held[1]}"
    assert resp.headers["X-Quart-Layers"] == f"{(span or held)[0]}-{(span or held)[1]}"
    return resp.body


def _splits(s: int, e: int) -> list[list[tuple[int, int]]]:
    """Every split of [s, e) in two, and one in three when it has at least three layers."""
    out = [[(s, c), (c, e)] for c in range(s + 1, e)]
    if e - s >= 3:
        a, b = s + 1, s + (e - s) // 2 + 1
        out.append([(s, a), (a, b), (b, e)])
    return out


def _output(body: bytes) -> torch.Tensor:
    tensors = wire.decode(body).tensors
    return tensors.get("logits", tensors.get("hidden_states"))


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("padded", [False, True])
def test_sub_ranges_chained_equal_the_whole_stage_and_model(models, family, padded):
    inputs = {"input_ids": IDS, "attention_mask": MASK} if padded else {"input_ids": IDS}
    first = wire.encode_bytes(inputs)
    reference = reference_model(models[family, 1])
    with torch.no_grad():
        expected_model = reference(**inputs).logits
    real = MASK.bool() if padded else torch.ones_like(IDS, dtype=torch.bool)
    for n in (1, 2):
        d = models[family, n]
        runtimes = [StageRuntime.load(StageConfig(model_dir=d, stage_index=i)) for i in range(n)]
        body = first
        for rt in runtimes:
            whole = _run(rt, body, None)
            for split in _splits(*rt.stage_range):
                part = body
                for span in split:
                    part = _run(rt, part, span)
                assert torch.equal(_output(part), _output(whole)), (family, n, split)  # exact, fp32
                if padded:
                    assert torch.equal(wire.decode(part).tensors["attention_mask"], MASK)
            body = whole
        got = _output(body)
        assert (got[real] - expected_model[real]).abs().max().item() <= 1e-5


def test_json_input_for_a_range_at_layer_zero_and_hidden_output(models):
    rt = StageRuntime.load(StageConfig(model_dir=models["llama", 1], stage_index=0))
    resp = rt.handle(json.dumps({"input_ids": IDS.tolist()}).encode(),
                     {"Content-Type": "application/json", "X-Quart-Layers": "0-2"})
    assert resp.status == 200, resp.body
    out = wire.decode(resp.body)
    assert list(out.tensors) == ["hidden_states"] and out.metadata["stage"] == "0"  # the rest is this stage's
    resp = rt.handle(resp.body, {"X-Quart-Layers": "2-6"})
    assert resp.status == 200 and wire.decode(resp.body).metadata["stage"] == "1"
    assert list(wire.decode(resp.body).tensors) == ["logits"]


@pytest.mark.parametrize("value", ["", "3", "a-b", "2-2", "3-1", "0-7", "-1-2", "0-99999999"])
def test_bad_or_outside_ranges_are_400_naming_layers(models, value):
    rt = StageRuntime.load(StageConfig(model_dir=models["llama", 1], stage_index=0))
    resp = rt.handle(wire.encode_bytes({"input_ids": IDS}), {"X-Quart-Layers": value})
    assert resp.status == 400, (value, resp.body)
    assert json.loads(resp.body)["field"] == "layers"
    assert resp.headers["X-Quart-Layers-Held"] == "0-6" and "X-Quart-Layers" not in resp.headers


def test_range_outside_a_later_stage_and_wrong_input_kind(models):
    d = models["llama", 2]
    rt = StageRuntime.load(StageConfig(model_dir=d, stage_index=1))
    s, e = rt.stage_range
    assert s > 0
    hidden = torch.zeros(2, 7, 32)
    resp = rt.handle(wire.encode_bytes({"hidden_states": hidden}), {"X-Quart-Layers": f"{s - 1}-{e}"})
    assert resp.status == 400 and json.loads(resp.body)["field"] == "layers"
    assert parse_layers(None, (s, e)) == (s, e)
    # a range not starting at 0 takes hidden_states: token ids are the wrong input there
    first = StageRuntime.load(StageConfig(model_dir=d, stage_index=0))
    resp = first.handle(wire.encode_bytes({"input_ids": IDS}), {"X-Quart-Layers": "1-2"})
    assert resp.status == 400 and json.loads(resp.body)["field"] == "hidden_states"


def test_emulated_time_scales_with_the_range(models, monkeypatch):
    import quart_stage.runtime as runtime_module

    d = models["llama", 1]
    m = Manifest.load(d)
    rt = StageRuntime.load(StageConfig(model_dir=d, stage_index=0, compute="emulated", emulated_mean_ms=120.0,
                                       emulated_cv=0.0))
    body = wire.encode_bytes({"input_ids": IDS})
    share = range_share(m.layer_parameter_counts, (0, 3), (0, 6))
    assert 0.2 < share < 0.8
    slept: list[float] = []  # what the emulation asks for (the wall clock of a loaded machine would blur it)
    monkeypatch.setattr(runtime_module.time, "sleep", slept.append)
    for span in ((0, 6), (0, 3)):
        resp = rt.handle(body, {"X-Quart-Layers": f"{span[0]}-{span[1]}"})
        assert resp.status == 200
    assert slept[0] == pytest.approx(0.12) and slept[1] == pytest.approx(0.12 * share)
    assert wire.decode(resp.body).tensors["hidden_states"].shape == (2, 7, 32)


def test_manifest_records_each_layers_bytes_and_sha256_in_file_order(models):
    import hashlib
    import os

    for family in CONFIGS:
        d = models[family, 2]
        for entry in Manifest.load(d).stages:
            data = open(os.path.join(d, entry.file), "rb").read()
            spans = entry.layer_bytes
            assert len(spans) == len(entry.layer_sha256) == entry.end - entry.start
            assert spans[0][0] == 0 and spans[-1][1] == len(data) == entry.file_bytes
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))
            for (lo, hi), sha in zip(spans, entry.layer_sha256, strict=True):
                assert hashlib.sha256(data[lo:hi]).hexdigest() == sha
    legacy = Manifest.load(models["llama", 1]).to_json()
    raw = json.loads(legacy)
    for s in raw["stages"]:
        del s["layer_bytes"], s["layer_sha256"]
    assert Manifest.from_dict(raw).stages[0].layer_bytes is None  # older manifests still load
