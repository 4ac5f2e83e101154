"""Chaining a partition's stages in-process reproduces the unpartitioned transformers model (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from quart_stage import wire
from quart_stage.config import StageConfig
from quart_stage.manifest import Manifest
from quart_stage.runtime import StageRuntime, read_stage_file
from quart_stage.verify import reference_model, reference_output
from quart_tools.partition import partition

FAMILIES = {"decoder": "tiny", "encoder": "tiny-encoder"}
STAGE_COUNTS = (1, 2, 3, 4, 8)
TOL = 1e-5


@pytest.fixture(scope="module")
def partitions(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    out = {}
    for family, preset in FAMILIES.items():
        for n in STAGE_COUNTS:
            d = root / f"{family}-{n}"
            partition(preset, n, str(d), progress=False, seed=7)
            out[family, n] = str(d)
    return out


@pytest.fixture(scope="module")
def references(partitions):
    # the stage files of every N hold the same weights (same seed), so one reference per family suffices
    return {family: reference_model(partitions[family, 1]) for family in FAMILIES}


def _chain(runtimes, body: bytes) -> torch.Tensor:
    for rt in runtimes:
        resp = rt.handle(body, {"Content-Type": wire.CONTENT_TYPE})
        assert resp.status == 200, resp.body
        for h in ("X-Quart-Deserialize-Ms", "X-Quart-Compute-Ms", "X-Quart-Serialize-Ms"):
            assert float(resp.headers[h]) >= 0
        assert resp.headers["X-Quart-Compute-Mode"] == "cpu"
        body = resp.body
    return wire.decode(body).tensors["logits"]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("n", STAGE_COUNTS)
def test_chained_stages_match_whole_model(partitions, references, family, n):
    d = partitions[family, n]
    manifest = Manifest.load(d)
    assert manifest.num_stages == n and manifest.family == family
    runtimes = [StageRuntime.load(StageConfig(model_dir=d, stage_index=i, num_stages=n)) for i in range(n)]
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, manifest.config["vocab_size"], (2, 11), generator=gen)
    expected = reference_output(references[family], ids)
    got = _chain(runtimes, wire.encode_bytes({"input_ids": ids}))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_tensors_attaches_without_copy(partitions, references, family):
    d = partitions[family, 2]
    manifest = Manifest.load(d)
    stores = [read_stage_file(d, e) for e in manifest.stages]
    runtimes = []
    for i, tensors in enumerate(stores):
        rt = StageRuntime.from_tensors(StageConfig(model_dir=d, stage_index=i), manifest, tensors)
        ptrs = {p.data_ptr() for p in rt.module.parameters()}
        assert ptrs <= {t.data_ptr() for t in tensors.values()}, "parameters must view the store's tensors"
        runtimes.append(rt)
    ids = torch.randint(0, manifest.config["vocab_size"], (1, 5))
    got = _chain(runtimes, wire.encode_bytes({"input_ids": ids}))
    assert (got - reference_output(references[family], ids)).abs().max().item() <= TOL


def test_uniform_method_is_equivalent_too(tmp_path, references):
    d = str(tmp_path / "uniform")
    manifest = partition("tiny", 3, d, method="uniform", progress=False, seed=7)
    assert [s.end - s.start for s in manifest.stages] == [4, 3, 3]  # DeepSpeed's partition_uniform of 10 layers
    runtimes = [StageRuntime.load(StageConfig(model_dir=d, stage_index=i)) for i in range(3)]
    ids = torch.randint(0, 512, (3, 4))
    got = _chain(runtimes, wire.encode_bytes({"input_ids": ids}))
    assert (got - reference_output(references["decoder"], ids)).abs().max().item() <= TOL
