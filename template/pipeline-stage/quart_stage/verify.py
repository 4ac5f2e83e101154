"""The unpartitioned reference: the whole transformers model rebuilt from a partition's stage files.

Used by the tests and the demo to show that chaining the stages reproduces the model's output.
Builds the full model in memory: for small models only.
"""

from __future__ import annotations

import torch

from quart_stage import families
from quart_stage.manifest import Manifest
from quart_stage.runtime import read_stage_file


def reference_model(model_dir: str) -> torch.nn.Module:
    """The whole model (transformers class of the manifest's family) with every stage's tensors loaded."""
    manifest = Manifest.load(model_dir)
    if not manifest.has_weights:
        raise ValueError(f"{model_dir} was partitioned without weights; there is nothing to compare against")
    cfg = families.make_config(manifest.config)
    tensors: dict[str, torch.Tensor] = {}
    for entry in manifest.stages:
        tensors.update(read_stage_file(model_dir, entry))
    model = families.model_class(cfg)(cfg)
    model.load_state_dict(tensors, strict=True)
    return model.eval()


@torch.inference_mode()
def reference_output(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the whole model for `input_ids` (what the last stage must return)."""
    return model(input_ids=input_ids).logits
