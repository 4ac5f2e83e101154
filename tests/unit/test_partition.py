"""`quartctl partition`: DeepSpeed split, balance, manifest, stack.yml, checkpoints, sized stages."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch
import yaml
from quart_stage import wire
from quart_stage.config import StageConfig
from quart_stage.manifest import Manifest
from quart_stage.runtime import StageRuntime, read_stage_file
from quart_tools.partition import main, partition, split_layers, stage_size_config
from support.paths import REPO


@pytest.mark.parametrize("preset", ["small", "small-encoder"])
def test_small_preset_eight_stages_are_balanced(tmp_path, preset):
    m = partition(preset, 8, str(tmp_path / preset), weights="none", progress=False)
    sizes = [s.parameter_bytes for s in m.stages]
    assert max(sizes) <= 1.15 * (sum(sizes) / len(sizes)), sizes
    assert 100e6 <= sum(sizes) <= 500e6  # the `small` preset is 100-500 MB
    assert m.method == "parameters" and m.num_stages == 8


def test_split_layers_returns_python_ints_and_refuses_empty_stages():
    bounds = split_layers([5, 1, 1, 1, 1, 5], 3)
    assert all(type(b) is int for b in bounds) and bounds[0] == 0 and bounds[-1] == 6
    assert split_layers(list(np.ones(10, dtype=np.int64)), 4, "uniform") == [0, 3, 6, 8, 10]
    with pytest.raises(ValueError, match="cannot split 3 layers"):
        split_layers([1, 1, 1], 4)
    with pytest.raises(ValueError, match="--method"):
        split_layers([1, 1, 1], 2, "bogus")


def test_manifest_files_and_stack_yml(tmp_path):
    out = str(tmp_path / "tiny")
    m = partition("tiny", 3, out, progress=False, stack={"scale_max": 5, "concurrency": 2})
    loaded = Manifest.load(out)
    assert loaded == m
    assert m.model == "tiny" and m.family == "decoder" and m.config["model_type"] == "llama"
    assert [s.start for s in m.stages] + [m.stages[-1].end] == [0, *[s.end for s in m.stages]]
    assert m.stages[-1].end == len(m.layers) == 10
    for s in m.stages:
        path = os.path.join(out, s.file)
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == s.sha256
        assert os.path.getsize(path) == s.file_bytes
        tensors = read_stage_file(out, s)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) == s.parameter_bytes
        assert s.layers == m.layers[s.start : s.end]
    doc = yaml.safe_load(open(os.path.join(out, "stack.yml")))
    assert doc["provider"] == {"name": "openfaas", "gateway": "http://127.0.0.1:8080"}
    assert list(doc["functions"]) == ["tiny-stage-0", "tiny-stage-1", "tiny-stage-2"]
    fn = doc["functions"]["tiny-stage-1"]
    assert fn["lang"] == "pipeline-stage" and fn["handler"].endswith("functions/decoder-lm")
    assert os.path.isfile(os.path.join(out, fn["handler"], "handler.py"))
    env = fn["environment"]
    assert env["QUART_MODEL_DIR"] == os.path.abspath(out) and env["QUART_STAGE_INDEX"] == "1"
    assert env["QUART_NUM_STAGES"] == "3" and env["QUART_COMPUTE"] == "cpu"
    assert StageConfig.from_env(env).stage_index == 1
    assert fn["labels"] == {"com.openfaas.scale.min": "1", "com.openfaas.scale.max": "5",
                            "com.openfaas.scale.factor": "20", "com.openfaas.scale.zero": "false",
                            "com.quart.model": "tiny", "com.quart.stage": "1", "com.quart.stages": "3",
                            "com.quart.concurrency": "2"}
    assert "constraints" not in fn and "annotations" not in fn  # GPU placement only for cuda stages
    assert fn["limits"]["memory"].endswith("Mi") and fn["limits"]["cpu"] == "1"


def test_random_weights_are_deterministic_by_seed(tmp_path):
    a = partition("tiny", 2, str(tmp_path / "a"), seed=5, progress=False)
    b = partition("tiny", 2, str(tmp_path / "b"), seed=5, progress=False)
    c = partition("tiny", 2, str(tmp_path / "c"), seed=6, progress=False)
    assert [s.sha256 for s in a.stages] == [s.sha256 for s in b.stages] != [s.sha256 for s in c.stages]


def _chain(out: str, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    m = Manifest.load(out)
    body = wire.encode_bytes({"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask})
    for i in range(m.num_stages):
        r = StageRuntime.load(StageConfig(model_dir=out, stage_index=i)).handle(body, {})
        assert r.status == 200, r.body
        body = r.body
    return wire.decode(body).tensors["logits"]


@pytest.mark.parametrize("kind", ["llama-tied-sharded", "bert", "opt", "mistral-window", "qwen2"])
def test_hf_checkpoint_folder_partitions_lazily_and_matches(tmp_path, kind):
    import transformers

    torch.manual_seed(0)
    if kind == "llama-tied-sharded":
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                       vocab_size=128, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "bert":
        cfg = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      vocab_size=128, max_position_embeddings=64)
        model = transformers.BertForMaskedLM(cfg)
    elif kind == "mistral-window":  # sequence longer than the sliding window: needs the windowed mask
        cfg = transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128, sliding_window=4)
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=128)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=3, num_attention_heads=4,
                                     vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=32)
        model = transformers.OPTForCausalLM(cfg)
    model.eval()
    src = tmp_path / f"my-{kind}"
    model.save_pretrained(src, max_shard_size="20KB" if "sharded" in kind else "1GB")
    assert len(list(src.glob("*.safetensors"))) >= (2 if "sharded" in kind else 1)
    out = str(tmp_path / "parts")
    m = partition(str(src), 3, out, progress=False)
    assert m.model == f"my-{kind}" and m.extra["weights"] == "checkpoint"
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert (_chain(out, ids) - expected).abs().max().item() <= 1e-5
    # a padded batch (left-padded row 0, right-padded row 1) with its attention_mask: the same as the whole
    # model given the same mask, at every real token (padding positions carry no meaning)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (_chain(out, ids, mask)[real] - expected[real]).abs().max().item() <= 1e-5


def test_stage_size_helper_hits_the_target(tmp_path):
    config = stage_size_config(6, stages=2)
    m = partition(config, 2, str(tmp_path / "sized"), progress=False)
    for s in m.stages:
        assert 0.85 * 6e6 <= s.parameter_bytes <= 1.15 * 6e6, s.parameter_bytes
        assert abs(s.file_bytes - s.parameter_bytes) < 64 << 10
    assert m.model == "sized-6mb"


def test_paper_config_without_weights_gives_an_emulated_stack(tmp_path):
    out = str(tmp_path / "llama")
    m = partition("llama-7b", 8, out, progress=False)
    assert not m.has_weights and m.dtype == "float16" and m.profile == "llama-7b"
    assert 6.5e9 < sum(s.parameter_count for s in m.stages) < 7e9
    assert not [f for f in os.listdir(out) if f.endswith(".safetensors")]
    env = yaml.safe_load(open(os.path.join(out, "stack.yml")))["functions"]["llama-7b-stage-0"]["environment"]
    assert env["QUART_COMPUTE"] == "emulated" and env["QUART_PROFILE"] == "llama-7b"
    rt = StageRuntime.load(StageConfig.from_env(env))
    assert rt.module is None and rt.service_time.mean_ms == pytest.approx(
        243.0 * m.stages[0].parameter_bytes / sum(s.parameter_bytes for s in m.stages))
    with pytest.raises(Exception, match="without weights"):
        StageRuntime.load(StageConfig(model_dir=out, stage_index=0))


def test_cli(tmp_path, capsys):
    assert main(["--model", "tiny-encoder", "--stages", "2", "--out", str(tmp_path / "e")]) == 0
    assert "2 stages by parameters" in capsys.readouterr().out
    assert main(["--model", "nope", "--stages", "2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "neither a packaged pretrained model (minilm, smollm2), a preset (tiny" in err
    assert main(["--model", "wideresnet", "--stages", "4", "--out", str(tmp_path / "w")]) == 0
    doc = yaml.safe_load(open(tmp_path / "w" / "stack.yml"))
    env = doc["functions"]["wideresnet-stage-3"]["environment"]
    assert env["QUART_PROFILE"] == "wideresnet" and "QUART_MODEL_DIR" not in env


def test_top_level_stack_yml_is_the_demo_models(tmp_path):
    root = str(REPO)
    with open(os.path.join(root, "stack.yml")) as f:
        text = f.read()
    doc = yaml.safe_load(text)
    assert doc["provider"] == {"name": "openfaas", "gateway": "http://127.0.0.1:8080"}
    fns = doc["functions"]
    n = len(fns)
    assert list(fns) == [f"small-stage-{i}" for i in range(n)]
    for i, fn in enumerate(fns.values()):
        assert fn["lang"] == "pipeline-stage"
        assert os.path.isfile(os.path.join(root, fn["handler"], "handler.py"))
        assert fn["environment"]["QUART_STAGE_INDEX"] == str(i)
        assert fn["environment"]["QUART_NUM_STAGES"] == str(n)
        assert fn["labels"]["com.quart.model"] == "small" and fn["labels"]["com.quart.stages"] == str(n)
    # it is exactly what the recorded command writes (no hand edits that drift from the partitioner)
    command = text.splitlines()[1].removeprefix("# ")
    assert command.startswith(f"quartctl partition --model small --stages {n} ")
    partition("small", n, str(tmp_path / "small"), weights="none", progress=False, stack_out=str(tmp_path / "s.yml"),
              stack={"compute": "cpu", "model_dir_value": "build/models/small", "stack_dir": root})
    assert yaml.safe_load(open(tmp_path / "s.yml")) == doc
