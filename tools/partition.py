"""`quartctl partition`: split a model into N pipeline stages with DeepSpeed's partitioner.

The model is a preset name (`tiny`, `small-encoder`, `llama-7b`, ...), a Hugging-Face-format folder
(config.json + *.safetensors, or config.json alone for random weights), a config JSON file, or a config
dict. The layer list ``[embeddings, block_0..block_{L-1}, head]`` is split with
``deepspeed.runtime.utils.partition_balanced`` over per-layer parameter counts (method ``parameters``,
the rule of DeepSpeed's PipelineModule) or ``partition_uniform`` (method ``uniform``).

Stages are written one at a time and tensor by tensor (header first, then each tensor generated or read
lazily with safetensors' ``safe_open``, written, hashed and freed), so neither the model nor a whole stage
is ever in memory. Output: ``DIR/stage-<i>.safetensors``, ``DIR/manifest.json``, ``DIR/stack.yml`` and,
for presets, a byte-level ``tokenizer.json``.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from quart_stage import cliargs, families, wire
from quart_stage.manifest import TOKENIZER_EXTRAS, Manifest, StageEntry
from quart_stage.presets import PAPER_PROFILES, PRESET_DTYPES, preset_config, resolve_preset
from quart_tools.realmodels import REAL_MODELS, source_folder
from quart_tools.stackfile import GPU_CONSTRAINT, GPU_PROFILE, stack_document, write_stack

from keysmanager.registry import ModelRegistry, RegistryError

RANDOM_WEIGHTS_LIMIT = 64 << 30
"""`--weights auto` writes random weights only below this model size; paper models get `none`."""
METHODS = ("parameters", "uniform")
WEIGHTS = ("auto", "random", "checkpoint", "none")


@dataclass(frozen=True)
class Source:
    """Where a model comes from: its name, architecture config, and (optionally) a checkpoint folder."""

    name: str
    config: dict | None
    checkpoint_dir: str | None = None
    profile: str | None = None
    preset: str | None = None
    tokenizer_file: str | None = None


def resolve_model(model: str | Mapping) -> Source:
    """Turn a preset name, checkpoint folder, config file or config dict into a `Source`."""
    if isinstance(model, Mapping):
        config = dict(model)
        return Source(_safe_name(config.pop("_name", None) or f"{config.get('model_type', 'model')}-custom"), config)
    preset = resolve_preset(model)
    if preset is not None:
        return Source(_safe_name(model), preset_config(preset),
                      profile=preset if preset in PAPER_PROFILES else None, preset=preset)
    if model in PAPER_PROFILES:
        return Source(model, None, profile=model)
    if os.path.isdir(model):
        cfg_path = os.path.join(model, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{model} has no config.json: a model folder needs config.json (+ *.safetensors)")
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
        has_weights = bool(glob.glob(os.path.join(model, "*.safetensors")))
        tok = os.path.join(model, "tokenizer.json")
        return Source(_safe_name(os.path.basename(os.path.normpath(model))), config,
                      checkpoint_dir=model if has_weights else None,
                      tokenizer_file=tok if os.path.isfile(tok) else None)
    if os.path.isfile(model) and model.endswith(".json"):
        with open(model, encoding="utf-8") as f:
            config = json.load(f)
        return Source(_safe_name(os.path.splitext(os.path.basename(model))[0]), config)
    raise ValueError(
        f"model {model!r} is neither a packaged pretrained model ({', '.join(REAL_MODELS)}), a preset "
        f"({', '.join(['tiny', 'small', 'tiny-encoder', 'small-encoder', 'bert-21b', 'llama-7b', 'opt-66b'])}), "
        f"a paper profile ({', '.join(PAPER_PROFILES)}), a folder with config.json, nor a config .json file")


def _safe_name(name: str | None) -> str:
    """A DNS-safe function-name prefix (OpenFaaS function names are DNS labels)."""
    safe = re.sub(r"[^a-z0-9-]+", "-", (name or "model").lower()).strip("-")
    return safe or "model"


def split_layers(counts: list[int], stages: int, method: str = "parameters") -> list[int]:
    """Stage boundaries (N+1 Python ints) over the layer list, by DeepSpeed's partitioner."""
    # only DeepSpeed's pure-Python partitioner is used: no accelerator probe (and no "Setting accelerator to
    # CPU" warning on a machine without a GPU); an explicit DS_ACCELERATOR is kept
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    if stages < 1:
        raise ValueError("--stages must be at least 1")
    if stages > len(counts):
        raise ValueError(f"cannot split {len(counts)} layers (embeddings, blocks, head) into {stages} stages")
    if method == "parameters":
        parts = partition_balanced(weights=list(counts), num_parts=stages)
    elif method == "uniform":
        parts = partition_uniform(num_items=len(counts), num_parts=stages)
    else:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    bounds = [int(p) for p in parts]  # DeepSpeed returns numpy ints
    if any(b >= e for b, e in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"partition {bounds} has an empty stage; use fewer stages")
    return bounds


def stage_size_config(target_mb: float, stages: int = 1, family: str = "decoder", dtype: str = "float32",
                      blocks_per_stage: int = 2) -> dict:
    """An architecture config whose `stages` stages each hold about `target_mb` MB of parameters.

    Each stage gets `blocks_per_stage` transformer blocks of width h (h a multiple of 64) and the
    embeddings/head are kept small (vocab 512), so `partition(config, stages, ...)` lands within a few
    percent of the target. Used to make 100 MB, 1 GB and 4 GB stages for the KeysManager benchmarks.
    """
    itemsize = torch.empty((), dtype=wire.DTYPE_NAMES[dtype]).element_size()
    params = target_mb * 1e6 / itemsize / blocks_per_stage
    per_h2 = 16 if family == "decoder" else 12  # llama block (inter = 4h, 3 matrices) vs bert block
    hidden = max(64, int(round(math.sqrt(params / per_h2) / 64)) * 64)
    layers = blocks_per_stage * stages
    base = dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                num_attention_heads=max(1, hidden // 64), vocab_size=512, max_position_embeddings=512,
                tie_word_embeddings=False)
    if family == "decoder":
        return dict(model_type="llama", num_key_value_heads=max(1, hidden // 64), rms_norm_eps=1e-6,
                    _name=f"sized-{int(target_mb)}mb", **base)
    if family == "encoder":
        return dict(model_type="bert", _name=f"sized-enc-{int(target_mb)}mb", **base)
    raise ValueError(f"family must be decoder or encoder, got {family!r}")


class CheckpointReader:
    """Lazy access to the tensors of a safetensors checkpoint folder (one tensor in memory at a time)."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        self.files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not self.files:
            raise FileNotFoundError(f"{directory} holds no *.safetensors files")
        self._handles = {path: safe_open(path, framework="pt") for path in self.files}
        self.where: dict[str, str] = {}
        for path, handle in self._handles.items():
            for key in handle.keys():
                self.where[key] = path

    def find(self, names: list[str]) -> str | None:
        """The first of `names` (a tensor and its tied aliases, with common prefixes) the checkpoint has."""
        for name in names:
            for candidate in (name, *_prefix_variants(name)):
                if candidate in self.where:
                    return candidate
        return None

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self.where[key]].get_tensor(key)


def _prefix_variants(name: str) -> list[str]:
    """Names the same tensor has in checkpoints saved from the base model class (no task prefix)."""
    out = []
    for prefix in ("model.", "bert."):
        if name.startswith(prefix):
            out.append(name[len(prefix):])
    return out


TILE_ELEMENTS = 1 << 22
"""Tensors larger than this repeat one 16 MB normal block (at memcpy speed) instead of drawing every value."""
_TILE_CACHE: dict[int, torch.Tensor] = {}


def _random_tensor(spec: families.TensorSpec, dtype: torch.dtype, seed: int, std: float) -> torch.Tensor:
    """Deterministic random init by (seed, canonical name): tied names get equal values. Fast fill, not HF init.

    Norm weights are 1 and biases 0 (activations stay sane through many layers); matrices are N(0, std).
    Above TILE_ELEMENTS a tensor is a rotated repetition of one normal block per seed, so 1-4 GB stages
    are written at disk speed rather than at the ~200 MB/s of torch's normal_.
    """
    leaf = spec.canonical.rsplit(".", 1)[-1]
    norm_like = re.search(r"(norm|LayerNorm|layer_norm)", spec.canonical) is not None
    if leaf == "bias" or (leaf == "weight" and norm_like and len(spec.shape) == 1):
        value = 0.0 if leaf == "bias" else 1.0
        return torch.full(spec.shape, value, dtype=dtype)
    key = (seed * 1_000_003 + zlib.crc32(spec.canonical.encode())) & 0x7FFFFFFF
    numel = math.prod(spec.shape)
    if numel <= TILE_ELEMENTS:
        out = torch.empty(spec.shape, dtype=torch.float32)
        out.normal_(0.0, std, generator=torch.Generator().manual_seed(key))
        return out.to(dtype) if dtype != torch.float32 else out
    if (seed, std) not in _TILE_CACHE:
        _TILE_CACHE.clear()
        _TILE_CACHE[seed, std] = torch.empty(TILE_ELEMENTS).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
    block = _TILE_CACHE[seed, std].to(dtype)
    shift = key % TILE_ELEMENTS
    block = torch.cat([block[shift:], block[:shift]])
    out = torch.empty(numel, dtype=dtype)
    for start in range(0, numel, TILE_ELEMENTS):
        n = min(TILE_ELEMENTS, numel - start)
        out[start : start + n] = block[:n]
    return out.view(spec.shape)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                disable=not (enabled and sys.stderr.isatty()))


@dataclass(frozen=True)
class StageFileInfo:
    """What writing a stage file found: its size and sha256, and each layer's byte range and sha256."""

    size: int
    sha256: str
    layer_bytes: list[list[int]]
    layer_sha256: list[str]
    header_bytes: int = 0
    header_sha256: str = ""


def write_stage_file(path: str, specs: list[families.TensorSpec], produce, dtype: torch.dtype,
                     metadata: Mapping[str, str], progress=None, layers: tuple[int, int] | None = None
                     ) -> StageFileInfo:
    """Stream one stage file: header, then each tensor produced, written and hashed in turn.

    Tensors are written in layer order (``specs`` are; the wire encoder keeps insertion order), so each layer
    of ``layers`` (absolute ``[start, end)``) is one contiguous byte range of the file; the first one starts at
    0 (the header is verified with the stage's first layer). ``produce(spec)`` gives the tensor (cast to ``dtype``).
    """
    start, end = layers if layers is not None else (min(s.layer for s in specs), max(s.layer for s in specs) + 1)
    if [s.layer for s in specs] != sorted(s.layer for s in specs):
        raise ValueError("stage tensors must come in layer order (file order = layer order)")
    head, _ = wire.header_bytes({s.name: (dtype, s.shape) for s in specs}, metadata)
    digest = hashlib.sha256(head)
    size = len(head)
    spans = [[0, 0] for _ in range(start, end)]
    layer_digests = [hashlib.sha256() for _ in range(start, end)]
    layer_digests[0].update(head)
    spans[0][1] = size
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(head)
        for spec in specs:
            tensor = produce(spec)
            if tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{spec.name}: checkpoint shape {list(tensor.shape)} != config shape {list(spec.shape)}")
            data = wire.byte_view(tensor.to(dtype)).numpy()
            f.write(memoryview(data))
            digest.update(memoryview(data))
            layer_digests[spec.layer - start].update(memoryview(data))
            size += data.nbytes
            spans[spec.layer - start][1] = size
            if progress is not None:
                progress.update(data.nbytes)
            del tensor, data
    for i in range(1, len(spans)):  # contiguous: each layer starts where the one before it ends
        spans[i][0] = spans[i - 1][1]
        spans[i][1] = max(spans[i][1], spans[i][0])
    os.replace(tmp, path)
    return StageFileInfo(size, digest.hexdigest(), spans, [d.hexdigest() for d in layer_digests], len(head),
                         hashlib.sha256(head).hexdigest())


def partition(model: str | Mapping, stages: int, out: str, method: str = "parameters", *,
              weights: str = "auto", dtype: str | None = None, seed: int = 0, name: str | None = None,
              std: float = 0.02, stack: Mapping | None = None, stack_out: str | None = None,
              progress: bool = True, command: str | None = None) -> Manifest | None:
    """Partition `model` into `stages` stages under `out`; returns the manifest (None for profile-only models).

    weights: ``auto`` (checkpoint if the folder has one; random for presets/configs under 64 GB; none
    for paper models), ``random``, ``checkpoint`` or ``none`` (manifest + stack.yml only: emulated).
    stack: options of `quart_tools.stackfile.stack_document` (compute, scale_min, scale_max, concurrency, model_dir_value, ...).
    stack_out: where to write stack.yml (default ``out/stack.yml``); handler paths are relative to it.
    """
    if isinstance(model, str) and (model in REAL_MODELS or os.path.exists(model)):
        with tempfile.TemporaryDirectory(prefix="quart-source-") as work:
            real = source_folder(model, work)  # a packaged pretrained model (quart_tools.realmodels)
            if real is not None:
                made = partition(real[1], stages, out, method, weights=weights, dtype=dtype, seed=seed,
                                 name=name or real[0], std=std, stack=stack, stack_out=stack_out,
                                 progress=progress, command=command)
                made = dataclasses.replace(made, source=real[2])  # the package's files, not the work folder
                made.save(out)
                return made
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    src = resolve_model(model)
    model_name = _safe_name(name) if name else src.name
    os.makedirs(out, exist_ok=True)
    stack = dict(stack or {})
    stack_path = stack_out or os.path.join(out, "stack.yml")
    stack.setdefault("stack_dir", os.path.dirname(os.path.abspath(stack_path)))
    if src.config is None:  # emulated-only paper profile: stack.yml with parameter-free stages
        stack.setdefault("compute", "emulated")
        stack["model_dir_value"] = None
        doc = stack_document(model_name, "emulated", stages, out, profile=src.profile, **stack)
        write_stack(doc, stack_path, command)
        return None
    cfg = families.make_config(src.config)
    plan = families.plan_for(cfg)
    dtype_name = dtype or _config_dtype(src) or "float32"
    torch_dtype = wire.DTYPE_NAMES[dtype_name]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    specs = families.tensor_specs(cfg)
    counts = families.layer_parameter_counts(cfg, specs)
    bounds = split_layers(counts, stages, method)
    if weights == "auto":
        if src.checkpoint_dir:
            weights = "checkpoint"
        elif src.profile or sum(counts) * itemsize > RANDOM_WEIGHTS_LIMIT:
            weights = "none"
        else:
            weights = "random"
    reader = None
    if weights == "checkpoint":
        if not src.checkpoint_dir:
            raise ValueError(f"--weights checkpoint needs a folder with *.safetensors; {model!r} has none")
        reader = CheckpointReader(src.checkpoint_dir)
    tied = {}
    for spec in specs:
        tied.setdefault(spec.canonical, []).append(spec.name)
    entries = []
    layer_list = families.layer_names(cfg)
    total_bytes = sum(counts) * itemsize if weights != "none" else 0
    with _progress(total_bytes, f"partition {model_name}", progress) as bar:
        for index, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
            stage_specs = [s for s in specs if start <= s.layer < end]
            n_params = sum(math.prod(s.shape) for s in stage_specs)
            file_name, file_bytes, sha, layer_bytes, layer_sha = None, None, None, None, None
            header: dict = {}
            if weights != "none":
                file_name = f"stage-{index}.safetensors"
                meta = {"model": model_name, "stage": str(index), "layers": f"{start}:{end}"}
                if reader is not None:
                    def produce(spec, reader=reader):
                        key = reader.find([spec.name, *[n for n in tied[spec.canonical] if n != spec.name]])
                        if key is None:
                            raise KeyError(f"checkpoint {src.checkpoint_dir} has no tensor {spec.name}")
                        return reader.get(key)
                else:
                    def produce(spec):
                        return _random_tensor(spec, torch_dtype, seed, std)
                info = write_stage_file(os.path.join(out, file_name), stage_specs, produce, torch_dtype, meta, bar,
                                        (start, end))
                file_bytes, sha, layer_bytes, layer_sha = info.size, info.sha256, info.layer_bytes, info.layer_sha256
                header = {"header_bytes": info.header_bytes, "header_sha256": info.header_sha256}
            entries.append(StageEntry(index=index, start=start, end=end, layers=layer_list[start:end],
                                      file=file_name, parameter_count=n_params, parameter_bytes=n_params * itemsize,
                                      sha256=sha, file_bytes=file_bytes, layer_bytes=layer_bytes,
                                      layer_sha256=layer_sha, **header))
    tokenizer = _write_tokenizer(src, out, cfg)
    manifest = Manifest(
        model=model_name, family=plan.family, model_type=plan.model_type, dtype=dtype_name, method=method,
        config=families.config_to_dict(cfg), layers=layer_list, layer_parameter_counts=counts, stages=entries,
        source=src.preset or src.checkpoint_dir or "config", profile=src.profile, tokenizer=tokenizer,
        extra={"weights": weights, "seed": seed} if weights == "random" else {"weights": weights},
    )
    for stale in glob.glob(os.path.join(out, "stage-*.safetensors")):
        if os.path.basename(stale) not in {e.file for e in entries}:
            os.remove(stale)
    manifest.save(out)
    if weights == "none":
        stack.setdefault("compute", "emulated")
    doc = stack_document(model_name, plan.family, stages, out, profile=src.profile, manifest=manifest, **stack)
    write_stack(doc, stack_path, command)
    return manifest


def _config_dtype(src: Source) -> str | None:
    if src.preset in PRESET_DTYPES:
        return PRESET_DTYPES[src.preset]
    if src.checkpoint_dir and src.config:
        value = src.config.get("torch_dtype") or src.config.get("dtype")
        if value in wire.DTYPE_NAMES:
            return value
    return None


def _write_tokenizer(src: Source, out: str, cfg) -> str | None:
    """Copy a checkpoint's tokenizer.json (and its config and chat template); for presets write a byte-level
    one (ids 0..255)."""
    target = os.path.join(out, "tokenizer.json")
    if src.tokenizer_file:
        shutil.copyfile(src.tokenizer_file, target)
        for extra in TOKENIZER_EXTRAS:  # special tokens and the chat template: the gateway's generation API reads them
            path = os.path.join(os.path.dirname(src.tokenizer_file), extra)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(out, extra))
        return "tokenizer.json"
    if src.preset and cfg.vocab_size >= 256:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.save(target)
        return "tokenizer.json"
    return None


# --- CLI -------------------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl partition", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="preset (tiny, small, tiny-encoder, small-encoder, bert-21b, llama-7b, opt-66b, "
                        "whisper-9b, wideresnet, sized), a packaged pretrained model (minilm, smollm2, or a path "
                        "to its files: a sentence-transformers folder or a .gguf), HF safetensors folder, "
                        "or config .json")
    p.add_argument("--stages", type=int, required=True, help="number of pipeline stages N")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--method", choices=METHODS, default="parameters", help="DeepSpeed method (default parameters)")
    p.add_argument("--weights", choices=WEIGHTS, default="auto", help="where weights come from (default auto)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="parameter dtype (default: the checkpoint's, fp16 for paper models, else float32)")
    p.add_argument("--seed", type=int, default=0, help="random-weight seed (default 0)")
    p.add_argument("--name", default=None, help="model name (default: preset or folder name)")
    p.add_argument("--target-stage-mb", type=float, default=None,
                   help="with --model sized: build a config whose stages hold about this many MB each")
    p.add_argument("--family", choices=("decoder", "encoder"), default="decoder", help="family for --model sized")
    p.add_argument("--compute", choices=("cpu", "cuda", "emulated"), default=None,
                   help="QUART_COMPUTE in stack.yml (default cpu; emulated for weightless partitions)")
    p.add_argument("--emulated-mean-ms", type=float, default=None, help="QUART_EMULATED_MEAN_MS in stack.yml")
    p.add_argument("--model-dir-value", default="", help="QUART_MODEL_DIR in stack.yml (default: absolute --out)")
    p.add_argument("--stack-out", default=None, help="write stack.yml here (default DIR/stack.yml)")
    p.add_argument("--scale-min", type=int, default=1)
    p.add_argument("--scale-max", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight per replica (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1)")
    p.add_argument("--gateway", default="http://127.0.0.1:8080")
    p.add_argument("--image", default=None)
    p.add_argument("--gpu-constraint", default=GPU_CONSTRAINT,
                   help=f"constraint of cuda stages (default {GPU_CONSTRAINT}; '' = none)")
    p.add_argument("--gpu-profile", default=GPU_PROFILE,
                   help=f"com.openfaas.profile annotation of cuda stages (default {GPU_PROFILE}; '' = none)")
    p.add_argument("--upload", metavar="URL", default=None,
                   help="then upload the model to the registry at s3://bucket/prefix (endpoint and credentials: "
                        "QUART_REGISTRY_ENDPOINT / AWS_* settings) and write QUART_MODEL_URL into stack.yml")
    args = p.parse_args(argv)
    model: str | dict = args.model
    if args.model == "sized":
        if args.target_stage_mb is None:
            p.error("--model sized needs --target-stage-mb")
        model = stage_size_config(args.target_stage_mb, args.stages, args.family, args.dtype or "float32")
    stack = {"scale_min": args.scale_min, "scale_max": args.scale_max, "concurrency": args.concurrency,
             "threads": args.threads, "gateway": args.gateway, "image": args.image,
             "model_dir_value": args.model_dir_value, "emulated_mean_ms": args.emulated_mean_ms,
             "model_url": args.upload, "gpu_constraint": args.gpu_constraint, "gpu_profile": args.gpu_profile}
    if args.compute:
        stack["compute"] = args.compute
    try:
        manifest = partition(model, args.stages, args.out, args.method, weights=args.weights, dtype=args.dtype,
                             seed=args.seed, name=args.name, stack=stack, stack_out=args.stack_out,
                             command="quartctl partition " + " ".join(argv))
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"quartctl partition: {str(exc).strip(chr(34))}", file=sys.stderr)
        return 2
    if manifest is None:
        print(f"{args.model}: emulated profile only; wrote {os.path.join(args.out, 'stack.yml')}")
        return 0
    mean = sum(s.parameter_bytes for s in manifest.stages) / manifest.num_stages
    print(f"{manifest.model}: {manifest.family} ({manifest.model_type}, {manifest.dtype}), "
          f"{len(manifest.layers)} layers -> {manifest.num_stages} stages by {manifest.method}")
    for s in manifest.stages:
        ratio = s.parameter_bytes / mean if mean else 0.0
        print(f"  stage {s.index}: layers {s.layers[0]}..{s.layers[-1]} [{s.start},{s.end}) "
              f"{s.parameter_bytes / 1e6:9.2f} MB ({ratio:.2f}x mean) {s.file or '(no weights)'}")
    print(f"wrote {args.out}/manifest.json and {args.stack_out or os.path.join(args.out, 'stack.yml')}")
    if args.upload:
        try:
            keys = ModelRegistry(args.upload).upload(Path(args.out), progress=True)
        except RegistryError as exc:
            print(f"quartctl partition: {exc}", file=sys.stderr)
            return 2
        print(f"uploaded {len(keys)} objects to {args.upload}")
    return 0
