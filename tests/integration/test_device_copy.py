"""quart_stage.device_copy: the staged copy moves every byte, chunk boundaries included; the CUDA bench
answers without a GPU. (The CUDA figures themselves come from `quartctl bench cuda` on a GPU machine.)"""

from __future__ import annotations

import json

import pytest
import torch
from quart_stage.config import StageConfig
from quart_stage.device_copy import move_module, staged_copy
from quart_stage.settings import ConfigError
from quart_tools.cli import main
from torch import nn


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096, 1 << 20])
def test_staged_copy_moves_every_byte_across_chunk_boundaries(chunk):
    gen = torch.Generator().manual_seed(chunk)
    src = [torch.randn(37, 11, generator=gen), torch.randint(0, 9, (5,), generator=gen), torch.empty(0),
           torch.randn(3, 5, generator=gen).to(torch.float16), torch.tensor([True, False])]
    dst = [torch.empty_like(t) for t in src]
    assert staged_copy(list(zip(src, dst, strict=True)), chunk_bytes=chunk) == sum(t.nbytes for t in src)
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))


def test_move_module_keeps_values_and_rejects_unknown_methods():
    module = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert move_module(module, torch.device("cpu"), "staged") == sum(v.nbytes for v in before.values())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    with pytest.raises(ValueError, match="staged"):
        move_module(module, torch.device("cpu"), "teleport")


def test_device_copy_setting_is_checked():
    assert StageConfig.from_env({"QUART_COMPUTE": "emulated", "QUART_PROFILE": "bert-21b"}).device_copy == "auto"
    with pytest.raises(ConfigError, match="QUART_DEVICE_COPY"):
        StageConfig.from_env({"QUART_COMPUTE": "emulated", "QUART_PROFILE": "bert-21b", "QUART_DEVICE_COPY": "x"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_cuda_bench_says_nothing_was_measured_without_a_gpu(tmp_path):
    out = tmp_path / "cuda.json"
    assert main(["bench", "cuda", "--sizes-gb", "0.001", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["cuda"] is False and "no CUDA" in doc["reason"] and "rows" not in doc
