"""Model families: how a transformers model is cut into a layer list and how a slice of it runs.

The layer list of every model is ``[embeddings, block_0 .. block_{L-1}, head]``. A `LayerPlan` maps a
transformers model class onto that list by parameter-name prefixes, so partitioning, loading and the
stage forward all agree on which tensor belongs to which layer. A stage keeps the original tensor
names (``model.layers.3.mlp.up_proj.weight``), so a stage file is a slice of an ordinary checkpoint.

Families: ``decoder`` (LLaMA-style: llama/mistral/qwen2; and OPT) and ``encoder`` (BERT). Models are
built on the ``meta`` device (no memory, no compute) and only the stage's tensors are attached, by
reference, with ``load_state_dict(assign=True)``: tensors handed in by a shared-memory store are
never copied.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from quart_stage import ragged

FAMILIES = ("decoder", "encoder")
SEGMENT_LENGTHS = "segment_lengths"  # quart_stage.inputs.SEGMENT_LENGTHS: a packed row's sequence lengths
Mask = torch.Tensor | ragged.Segments | None  # a padding mask, a packed row's segments, or none


@dataclass(frozen=True)
class LayerPlan:
    """Where the layers of one transformers model class live."""

    model_type: str
    family: str
    model_class: str
    embed_prefixes: tuple[str, ...]
    blocks_prefix: str
    head_prefixes: tuple[str, ...]

    def layer_of(self, name: str, num_blocks: int) -> int:
        """Index in the layer list of the parameter called `name`."""
        if name.startswith(self.blocks_prefix + "."):
            return int(name[len(self.blocks_prefix) + 1 :].split(".", 1)[0]) + 1
        if any(name == p or name.startswith(p + ".") for p in self.embed_prefixes):
            return 0
        if any(name == p or name.startswith(p + ".") for p in self.head_prefixes):
            return num_blocks + 1
        raise ValueError(f"parameter {name!r} belongs to no layer of a {self.model_type} model")


_LLAMA_LIKE = dict(embed_prefixes=("model.embed_tokens",), blocks_prefix="model.layers",
                   head_prefixes=("model.norm", "lm_head"))
PLANS: dict[str, LayerPlan] = {
    "llama": LayerPlan("llama", "decoder", "LlamaForCausalLM", **_LLAMA_LIKE),
    "mistral": LayerPlan("mistral", "decoder", "MistralForCausalLM", **_LLAMA_LIKE),
    "qwen2": LayerPlan("qwen2", "decoder", "Qwen2ForCausalLM", **_LLAMA_LIKE),
    "opt": LayerPlan(
        "opt", "decoder", "OPTForCausalLM",
        embed_prefixes=("model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.project_in"),
        blocks_prefix="model.decoder.layers",
        head_prefixes=("model.decoder.final_layer_norm", "model.decoder.project_out", "lm_head"),
    ),
    "bert": LayerPlan(
        "bert", "encoder", "BertForMaskedLM",
        embed_prefixes=("bert.embeddings",), blocks_prefix="bert.encoder.layer", head_prefixes=("cls",),
    ),
    # sentence embeddings (MiniLM): BERT blocks, head = parameter-free mean pooling + L2 norm (quart_stage.pooling)
    "bert-sentence": LayerPlan(
        "bert", "encoder", "quart_stage.pooling:SentenceBert",
        embed_prefixes=("bert.embeddings",), blocks_prefix="bert.encoder.layer", head_prefixes=("pooling",),
    ),
}
PLAN_KEY = "quart_plan"
"""Config key naming a PLANS entry other than the one of its model_type (e.g. ``bert-sentence``)."""


def plan_for(config: Mapping | object) -> LayerPlan:
    model_type = config["model_type"] if isinstance(config, Mapping) else config.model_type
    model_type = (config.get(PLAN_KEY) if isinstance(config, Mapping) else getattr(config, PLAN_KEY, None)) or model_type
    try:
        return PLANS[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(PLANS)}"
        ) from None


def make_config(config: Mapping):
    """A transformers config from a plain dict (with ``model_type``), using SDPA attention."""
    import transformers

    kwargs = {k: v for k, v in dict(config).items() if k not in {"model_type", "architectures", "transformers_version"}}
    cfg = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    cfg._attn_implementation = "sdpa"
    return cfg


def config_to_dict(cfg) -> dict:
    """The JSON-able architecture config (what manifest.json stores)."""
    d = cfg.to_diff_dict() if hasattr(cfg, "to_diff_dict") else dict(cfg)
    d["model_type"] = cfg.model_type
    d.pop("transformers_version", None)
    d.pop("_attn_implementation_autoset", None)
    return d


def num_blocks(cfg) -> int:
    return int(cfg.num_hidden_layers)


def layer_names(cfg) -> list[str]:
    return ["embeddings", *[f"block_{i}" for i in range(num_blocks(cfg))], "head"]


def model_class(cfg) -> type:
    """The whole-model class of a plan: a transformers class name, or ``module:Class``."""
    import importlib

    import transformers

    name = plan_for(cfg).model_class
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    return getattr(transformers, name)


def build_skeleton(cfg) -> nn.Module:
    """The whole model on the meta device: shapes and names only, no memory, no compute."""
    cls = model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg)
    return model.eval()


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a model: its name, layer, shape, and the name it is tied to (its canonical name)."""

    name: str
    layer: int
    shape: tuple[int, ...]
    canonical: str


def tensor_specs(cfg, skeleton: nn.Module | None = None) -> list[TensorSpec]:
    """Every stored tensor of the model in layer order; tied aliases appear once per name."""
    skeleton = build_skeleton(cfg) if skeleton is None else skeleton
    plan, blocks = plan_for(cfg), num_blocks(cfg)
    canonical_of: dict[int, str] = {}
    specs = []
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        canonical = canonical_of.setdefault(id(param), name)
        specs.append(TensorSpec(name, plan.layer_of(name, blocks), tuple(param.shape), canonical))
    specs.sort(key=lambda s: s.layer)  # stable: keeps module order inside a layer
    return specs


def layer_parameter_counts(cfg, specs: list[TensorSpec] | None = None) -> list[int]:
    """Parameters per entry of the layer list (what DeepSpeed's `parameters` method balances)."""
    specs = tensor_specs(cfg) if specs is None else specs
    counts = [0] * (num_blocks(cfg) + 2)
    for spec in specs:
        n = 1
        for dim in spec.shape:
            n *= dim
        counts[spec.layer] += n
    return counts


class StageModule(nn.Module):
    """Layers ``[start, end)`` of the layer list of one model, and their forward.

    Built from a meta skeleton: only the stage's submodules are kept, and their tensors are attached by
    reference. Inputs: ``input_ids`` (stage holding the embeddings) or ``hidden_states``, and optionally
    ``attention_mask`` (batch × sequence, 1 = token, 0 = padding) for padded batches, or ``segment_lengths``
    for a packed batch (one row of sequences end to end, :class:`quart_stage.ragged.Segments`); output:
    ``hidden_states`` or, for the stage holding the head, ``logits``.
    """

    def __init__(self, cfg, start: int, end: int, tensors: Mapping[str, torch.Tensor]):
        super().__init__()
        self.plan = plan_for(cfg)
        # SDPA; per session in a batched decode step, per sequence in a packed row (quart_stage.ragged)
        cfg = copy.deepcopy(cfg)
        cfg._attn_implementation = ragged.register()
        self.cfg = cfg
        self.start, self.end = start, end
        blocks = num_blocks(cfg)
        if not 0 <= start < end <= blocks + 2:
            raise ValueError(f"layer range [{start}, {end}) is outside the {blocks + 2} layers of this model")
        skeleton = build_skeleton(cfg)
        expected = {s.name for s in tensor_specs(cfg, skeleton) if start <= s.layer < end}
        missing = sorted(expected - set(tensors))
        if missing:
            raise ValueError(f"stage tensors are missing {len(missing)} names, e.g. {missing[:3]}")
        unexpected = sorted(set(tensors) - expected)
        if unexpected:
            raise ValueError(f"stage tensors include names outside layers [{start}, {end}): {unexpected[:3]}")
        skeleton.load_state_dict(dict(tensors), strict=False, assign=True)
        self.has_embed = start == 0
        self.has_head = end == blocks + 2
        root = skeleton
        self.blocks = nn.ModuleList(_get(root, self.plan.blocks_prefix)[max(start - 1, 0) : min(end - 1, blocks)])
        self.block_offset = max(start - 1, 0)
        self.embed = nn.ModuleDict()
        self.head = nn.ModuleDict()
        for prefix in self.plan.embed_prefixes if self.has_embed else ():
            module = _get(root, prefix, None)
            if module is not None:
                self.embed[prefix.replace(".", "_")] = module
        for prefix in self.plan.head_prefixes if self.has_head else ():
            module = _get(root, prefix, None)
            if module is not None:
                self.head[prefix.replace(".", "_")] = module
        self.rotary = None  # built by materialize_buffers (after fork)
        self.eval()

    # -- buffers that are computed, not stored (built lazily, after any fork) ---------------------
    def materialize_buffers(self, device: torch.device | str = "cpu") -> None:
        """Create the non-persistent buffers the meta skeleton left empty (rotary tables, position ids)."""
        if self.plan.family == "decoder" and self.plan.model_type != "opt" and len(self.blocks):
            import importlib

            module = importlib.import_module(type(self.blocks[0]).__module__)
            rotary_cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
            with torch.device(device):
                self.rotary = rotary_cls(self.cfg)
        if self.plan.model_type == "bert" and self.has_embed:
            emb = self.embed["bert_embeddings"]
            positions = torch.arange(self.cfg.max_position_embeddings, device=device).expand((1, -1))
            emb.register_buffer("position_ids", positions, persistent=False)
            emb.register_buffer("token_type_ids", torch.zeros_like(positions), persistent=False)
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if tensor.is_meta:
                raise RuntimeError(f"stage tensor {name} was never materialized")

    # -- forward --------------------------------------------------------------------------------
    @property
    def total_layers(self) -> int:
        return num_blocks(self.cfg) + 2

    @torch.inference_mode()
    def forward(self, inputs: Mapping[str, torch.Tensor], start: int | None = None,
                end: int | None = None, *, cache=None, past: int | torch.Tensor = 0, every: bool = False) -> torch.Tensor:
        """Run layers ``[start, end)`` (absolute, inside this stage's range; default: all of them).

        A sub-range runs the stage's own modules (no copy, no new module): input ``input_ids`` when it starts
        at layer 0, else ``hidden_states``; output ``logits`` when it ends at the head, else ``hidden_states``.
        Chaining consecutive sub-ranges gives exactly the whole range's output.

        With ``cache`` (a transformers ``Cache`` from :meth:`new_cache`, holding ``past`` positions of one
        sequence): the inputs are the sequence's next positions only; positions, rotary tables and masks
        continue from ``past``, the blocks append their keys and values to the cache, and the head (if held)
        runs on the last position only (on every new one with ``every``: a prompt's logprobs). A batched decode step (one new position per session): ``cache`` a
        :class:`quart_stage.ragged.RaggedCache` and ``past`` a 1-D tensor, each row's positions held.
        """
        lo = self.start if start is None else start
        hi = self.end if end is None else end
        if not self.start <= lo < hi <= self.end:
            raise ValueError(f"layers [{lo}, {hi}) are not inside this stage's [{self.start}, {self.end})")
        mask = inputs.get("attention_mask")
        if inputs.get(SEGMENT_LENGTHS) is not None:  # a packed row: positions and attention per sequence
            if cache is not None:
                raise ValueError("a packed batch (segment_lengths) has no KV cache")
            mask = ragged.Segments.of(inputs[SEGMENT_LENGTHS])
        hidden = self._embed(inputs, mask, past) if lo == 0 else inputs["hidden_states"]
        first, last = max(lo, 1), min(hi, self.total_layers - 1)  # block layers l run block l - 1
        if first < last:
            hidden = self._blocks(hidden, mask, first - 1 - self.block_offset, last - 1 - self.block_offset,
                                  cache, past)
        if hi == self.total_layers:
            hidden = self._head(hidden if cache is None or every else hidden[:, -1:], mask)
        return hidden

    def new_cache(self):
        """An empty KV cache for one sequence through this stage's blocks (decoders only): transformers'
        ``DynamicCache`` of the model's config, so sliding-window layers keep only their window. Layers of
        other stages stay empty (a cache layer allocates on its first update)."""
        from transformers import DynamicCache

        if self.plan.family != "decoder":
            raise ValueError(f"a {self.plan.model_type} model is not a decoder: it has no KV cache")
        return DynamicCache(config=self.cfg)

    def _embed(self, inputs: Mapping[str, torch.Tensor], mask: Mask, past: int = 0) -> torch.Tensor:
        ids = inputs["input_ids"]
        if self.plan.model_type == "bert":
            positions = ragged.segment_positions(mask, ids.device) if isinstance(mask, ragged.Segments) else None
            return self.embed["bert_embeddings"](input_ids=ids, token_type_ids=inputs.get("token_type_ids"),
                                                 position_ids=positions)
        if self.plan.model_type == "opt":
            hidden = self.embed["model_decoder_embed_tokens"](ids)
            if "model_decoder_project_in" in self.embed:
                hidden = self.embed["model_decoder_project_in"](hidden)
            positions = self._opt_positions(ids, mask, past)
            return hidden + self.embed["model_decoder_embed_positions"](None, 0, position_ids=positions)
        return self.embed["model_embed_tokens"](ids)

    @staticmethod
    def _opt_positions(ids: torch.Tensor, mask: Mask, past: int | torch.Tensor = 0) -> torch.Tensor:
        """OPT's learned positions count the tokens before each one (padding skipped), as OPTDecoder does;
        a cached sequence's new positions continue from ``past``, a packed row's restart per sequence."""
        if isinstance(mask, ragged.Segments):
            return ragged.segment_positions(mask, ids.device)
        if mask is None:
            return _positions(past, ids.shape[1], ids.device)
        return (torch.cumsum(mask, dim=1) * mask - 1).long()

    def _blocks(self, hidden: torch.Tensor, mask: Mask, lo: int, hi: int, cache=None,
                past: int | torch.Tensor = 0) -> torch.Tensor:
        """Blocks ``self.blocks[lo:hi]`` (indices into this stage's blocks)."""
        packed = isinstance(mask, ragged.Segments)
        positions = (ragged.segment_positions(mask, hidden.device) if packed
                     else _positions(past, hidden.shape[1], hidden.device))
        kwargs: dict = {"position_ids": positions}
        if self.plan.family == "decoder" and self.plan.model_type != "opt":
            kwargs["position_embeddings"] = self.rotary(hidden, positions)
        if cache is not None:
            kwargs.update(past_key_values=cache, use_cache=True)
        blocks = self.blocks[lo:hi]
        if isinstance(past, torch.Tensor) or packed:  # a batched decode step needs no mask; a packed row its segments
            masks = [mask if packed else None] * len(blocks)
        else:
            masks = self._attention_masks(hidden, mask, positions, len(blocks), self.block_offset + lo, cache)
        for block, block_mask in zip(blocks, masks, strict=True):
            out = block(hidden, attention_mask=block_mask, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def _attention_masks(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
                         count: int, offset: int, cache=None) -> list:
        """Each block's attention mask, built by transformers' own mask functions exactly as the whole model
        builds it: padding (``mask``), causality, Mistral's and Qwen2's sliding windows, and with a ``cache``
        the positions it already holds (sized from the cache layer of this stage's first block of each kind,
        as the whole model sizes them from its first). None where SDPA's ``is_causal`` (or no mask at all) is
        enough — a one-position decode step needs none."""
        from transformers import masking_utils

        if self.plan.family == "encoder":
            return [masking_utils.create_bidirectional_mask(config=self.cfg, inputs_embeds=hidden,
                                                            attention_mask=mask)] * count
        args = {"config": self.cfg, "inputs_embeds": hidden, "attention_mask": mask, "past_key_values": cache}
        if self.plan.model_type != "opt":  # OPTDecoder passes no position ids to its mask
            args["position_ids"] = positions
        if self.plan.model_type == "mistral" and getattr(self.cfg, "sliding_window", None) is not None:
            return [masking_utils.create_sliding_window_causal_mask(**args, layer_idx=offset)] * count
        types = getattr(self.cfg, "layer_types", None) if self.plan.model_type == "qwen2" else None
        kinds = [types[offset + i] if types else "full_attention" for i in range(count)]
        made = {}
        for kind in dict.fromkeys(kinds):  # each kind once, sized from its first block here
            create = (masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention"
                      else masking_utils.create_causal_mask)
            made[kind] = create(**args, layer_idx=offset + kinds.index(kind))
        return [made[kind] for kind in kinds]

    def _head(self, hidden: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        for module in self.head.values():  # a pooling head (takes_mask) needs the padding mask or the segments
            hidden = module(hidden, mask) if getattr(module, "takes_mask", False) else module(hidden)
        return hidden


def _positions(past: int | torch.Tensor, count: int, device) -> torch.Tensor:
    """Position ids ``[rows, count]`` continuing from ``past``: one int (a sequence), or one per row (a batch)."""
    if isinstance(past, torch.Tensor):
        return past.to(device).view(-1, 1) + torch.arange(count, device=device).view(1, -1)
    return torch.arange(past, past + count, device=device).unsqueeze(0)


def _get(root: nn.Module, dotted: str, default=...):
    module = root
    for part in dotted.split("."):
        if not hasattr(module, part):
            if default is ...:
                raise AttributeError(f"model has no submodule {dotted!r}")
            return default
        module = getattr(module, part)
    return module
