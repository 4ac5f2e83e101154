"""manifest.json: what a partitioned model folder holds (written by `quartctl partition`)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1


def check_file_name(name: object) -> None:
    """A stage ``file`` is a plain relative path inside the model folder: no ``..``, not absolute, no NUL
    (a crafted manifest must not make a replica open /etc/passwd). Raises ValueError."""
    if name is None:
        return
    if (not isinstance(name, str) or not name or "\x00" in name or os.path.isabs(name)
            or ".." in name.replace("\\", "/").split("/")):
        raise ValueError(f"stage file {name!r} must be a relative path inside the model folder")


def stage_path(directory: str | os.PathLike, name: str) -> str:
    """``directory/name``, resolved, and still inside ``directory`` (symbolic links followed). Raises ValueError."""
    check_file_name(name)
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"stage file {name!r} resolves outside the model folder {root}")
    return path


# Files beside tokenizer.json the gateway's generation API reads when a model has them (special tokens, the chat
# template); the partitioner copies them and the registry serves them.
TOKENIZER_EXTRAS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class StageEntry:
    """One stage: its layer range ``[start, end)`` in the manifest's layer list and its parameter file.

    file is None for parameter-free (emulated-only) partitions (`--weights none`). ``layer_bytes[i]`` is the
    byte range ``[offset, end)`` of layer ``start + i`` in the file and ``layer_sha256[i]`` its sha256: the
    ranges tile the file in layer order (the first starts at 0 and holds the header), so a file still arriving
    can be trusted layer by layer (KeysManager live start). ``header_bytes`` / ``header_sha256`` verify the
    header alone, so a part of the stage can be trusted before its first layer arrives (ParaServe part start).
    Older manifests lack them: such a stage cannot serve before its whole file (or first layer) is verified.
    """

    index: int
    start: int
    end: int
    layers: list[str]
    file: str | None
    parameter_count: int
    parameter_bytes: int
    sha256: str | None
    file_bytes: int | None = None
    layer_bytes: list[list[int]] | None = None
    layer_sha256: list[str] | None = None
    header_bytes: int | None = None  # the safetensors header's length (8-byte size + JSON), the start of layer 0
    header_sha256: str | None = None  # its sha256: a part start (ParaServe) trusts the header before layer 0

    @property
    def has_embeddings(self) -> bool:
        return self.start == 0


@dataclass(frozen=True)
class Manifest:
    """A partitioned model. `config` is the architecture config (transformers keys, with model_type)."""

    model: str
    family: str
    model_type: str
    dtype: str
    method: str
    config: dict
    layers: list[str]
    layer_parameter_counts: list[int]
    stages: list[StageEntry]
    source: str = ""
    profile: str | None = None
    tokenizer: str | None = None
    version: int = MANIFEST_VERSION
    extra: dict = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage(self, index: int) -> StageEntry:
        if not 0 <= index < len(self.stages):
            raise IndexError(f"model {self.model!r} has stages 0..{len(self.stages) - 1}, not {index}")
        return self.stages[index]

    @property
    def has_weights(self) -> bool:
        return all(s.file is not None for s in self.stages)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    def save(self, directory: str) -> str:
        path = os.path.join(directory, MANIFEST_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        data = dict(data)
        version = data.get("version", MANIFEST_VERSION)
        if version != MANIFEST_VERSION:
            raise ValueError(f"manifest version {version} is not supported (expected {MANIFEST_VERSION})")
        data["stages"] = [StageEntry(**s) for s in data["stages"]]
        for entry in data["stages"]:
            check_file_name(entry.file)
        return cls(**data)

    @classmethod
    def load(cls, directory: str) -> Manifest:
        """Read ``directory/manifest.json`` (raises FileNotFoundError with a clear message)."""
        path = os.path.join(directory, MANIFEST_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist: partition the model first (quartctl partition)")
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))
