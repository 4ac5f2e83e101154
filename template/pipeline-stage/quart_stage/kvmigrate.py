"""Moving a generation session's KV cache between replicas (ParaServe's consolidation, §6.2; docs/generation.md).

A ParaServe group serves a stage as P parts, each replica holding the KV cache of its own layers. When the
group consolidates, the caches are gathered to the worker that became whole: each part is exported as
``GET /_/sessions/<id>/kv`` and installed there with ``PUT /_/sessions/<id>/kv``; the stream then goes on
without a new prefill.

The format is safetensors (a JSON header and raw tensor bytes; never a pickle): tensors ``k.<layer>`` /
``v.<layer>`` (``layer`` the model's layer index of a block) and, for emulated compute, ``ids`` (the
session's token ids); the metadata entry ``quart_kv`` is JSON ``{"session", "tokens", "layers": [a, b],
"sha256": {name: hex}, "bytes": {name: n}}``. An import checks every tensor's length and sha256 and that
each one covers ``tokens`` positions before anything changes (400 ``field kv`` otherwise: the gateway then
replays the session instead).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

from quart_stage.errors import QuartError, invalid

KV_TYPE = "application/vnd.quart.kv+safetensors"
META = "quart_kv"
FIELD = "kv"


class EmulatedKV:
    """An emulated session's cache: its token ids and, per block layer held, key and value tensors of the
    model's width whose values are a pure function of (id, layer, column) — real bytes to move and check.
    Buffers grow by doubling, so a step writes only its new positions (as a paged cache does). The next token
    is ``blake2b(seed, ids)``: the same after a replay or a migration, on any replica."""

    def __init__(self, seed: int, width: int, dtype: torch.dtype = torch.float16):
        self.seed, self.width, self.dtype = seed, width, dtype
        self.ids: list[int] = []
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # layer → (keys, values, positions)

    @property
    def layers(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values, ``(1, 1, positions, width)`` views of the held positions."""
        return {layer: (k[:, :, :n], v[:, :, :n]) for layer, (k, v, n) in self._buffers.items()}

    def rows(self, ids: list[int], layer: int) -> torch.Tensor:
        cols = torch.arange(self.width, dtype=torch.int64)
        grid = (torch.tensor(ids, dtype=torch.int64).unsqueeze(1) * 31 + layer * 7 + cols) % 251
        return grid.to(self.dtype).unsqueeze(0).unsqueeze(0)  # (batch, heads, positions, width), as transformers'

    def put(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append positions to ``layer`` (a new layer starts with them)."""
        k, v, n = self._buffers.get(layer, (None, None, 0))
        new = keys.shape[-2]
        if k is None or n + new > k.shape[-2]:
            size = max(16, 2 * (n + new))
            grown = [torch.empty((1, 1, size, self.width), dtype=self.dtype) for _ in range(2)]
            if k is not None:
                grown[0][:, :, :n], grown[1][:, :, :n] = k[:, :, :n], v[:, :, :n]
            k, v = grown
        k[:, :, n:n + new], v[:, :, n:n + new] = keys, values
        self._buffers[layer] = (k, v, n + new)

    def holds(self, layer: int) -> bool:
        return layer in self._buffers

    def drop(self, layer: int) -> None:
        """Free ``layer``'s keys and values (a re-cut moved them to another replica)."""
        self._buffers.pop(layer, None)

    def append(self, ids: list[int], block_layers: range) -> None:
        """A step over ``ids`` through ``block_layers``: each layer's keys and values grow by those positions."""
        for layer in block_layers:
            keys = self.rows(ids, layer)
            self.put(layer, keys, keys + 1)
        self.ids.extend(ids)

    def token(self, vocab: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}:".encode(), digest_size=8)
        digest.update(b"".join(i.to_bytes(8, "big") for i in self.ids))
        return int.from_bytes(digest.digest(), "big") % vocab


def block_layers(span: tuple[int, int], total_layers: int) -> range:
    """The model layers of ``span`` that are blocks (layer 0 is the embeddings, the last the head)."""
    return range(max(span[0], 1), min(span[1], total_layers - 1))


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def cache_tensors(state: object, span: tuple[int, int], total_layers: int, start: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` (an `EmulatedKV` or a transformers ``DynamicCache``) for the blocks of ``span``,
    positions ``start`` on (a re-cut's last part: what came since its pre-copy)."""
    out: dict[str, torch.Tensor] = {}
    for layer in block_layers(span, total_layers):
        if isinstance(state, EmulatedKV):
            kv = state.layers.get(layer)
        else:
            cached = state.layers[layer - 1] if layer - 1 < len(state.layers) else None
            kv = (cached.keys, cached.values) if cached is not None and cached.is_initialized else None
        if kv is not None:
            out[f"k.{layer}"] = kv[0][..., start:, :].detach().cpu()
            out[f"v.{layer}"] = kv[1][..., start:, :].detach().cpu()
    if isinstance(state, EmulatedKV):
        out["ids"] = torch.tensor(state.ids, dtype=torch.int64)
    return out


def encode(session_id: str, tokens: int, span: tuple[int, int], tensors: Mapping[str, torch.Tensor],
           seed: int = 0, start: int = 0) -> bytes:
    """One part's cache as safetensors with each tensor's sha256 and length in the metadata (``seed``: an
    emulated session's; ``start``: the first position it holds)."""
    from safetensors.torch import save

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"session": session_id, "tokens": tokens, "from": start, "layers": list(span), "seed": seed,
            "sha256": {k: hashlib.sha256(_raw(v)).hexdigest() for k, v in tensors.items()},
            "bytes": {k: v.numel() * v.element_size() for k, v in tensors.items()}}
    return save(tensors, metadata={META: json.dumps(meta)})


def decode(body: bytes, session_id: str, tokens: int, start: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of an exported part, verified: the header names this session at ``tokens`` positions from
    ``start``, every tensor is listed with its length and sha256 and matches them, and covers those positions."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(bytes(body))  # safetensors: an 8-byte length, a JSON header, raw bytes
        header_len = int.from_bytes(body[:8], "little")
        meta = json.loads(json.loads(bytes(body[8:8 + header_len]))["__metadata__"][META])
    except (SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise invalid(FIELD, f"not a KV-cache export: {exc}") from None
    if meta.get("session") != session_id or meta.get("tokens") != tokens or meta.get("from", 0) != start:
        raise invalid(FIELD, f"the export is of session {meta.get('session')!r} at {meta.get('tokens')} positions "
                             f"from {meta.get('from', 0)}, not {session_id!r} at {tokens} from {start}")
    if set(meta.get("sha256", {})) != set(tensors) or set(meta.get("bytes", {})) != set(tensors):
        raise invalid(FIELD, "the export's header does not list exactly its tensors")
    for name, t in tensors.items():
        if t.numel() * t.element_size() != meta["bytes"][name]:
            raise invalid(FIELD, f"tensor {name}: {t.numel() * t.element_size()} bytes, the header says "
                                 f"{meta['bytes'][name]}")
        if hashlib.sha256(_raw(t)).hexdigest() != meta["sha256"][name]:
            raise invalid(FIELD, f"tensor {name}: sha256 differs from the header's (corrupted in transit)")
        positions = t.shape[0] if name == "ids" else t.shape[-2]
        if (name == "ids" and positions != tokens) or (name != "ids" and positions > tokens - start):
            raise invalid(FIELD, f"tensor {name} covers {positions} positions, the export holds {tokens - start}")
    return tensors, meta


def drop(state: object, span: tuple[int, int], total_layers: int) -> None:
    """Free the keys and values of the blocks of ``span`` in ``state`` (an `EmulatedKV` or a ``DynamicCache``)."""
    for layer in block_layers(span, total_layers):
        if isinstance(state, EmulatedKV):
            state.drop(layer)
        elif layer - 1 < len(state.layers):
            state.layers[layer - 1].reset()


def held_positions(state: object, layer: int) -> int:
    """The positions of ``layer`` that ``state`` holds (0: none)."""
    if isinstance(state, EmulatedKV):
        kv = state.layers.get(layer)
        return 0 if kv is None else kv[0].shape[-2]
    if layer - 1 >= len(state.layers) or not state.layers[layer - 1].is_initialized:
        return 0
    return state.layers[layer - 1].get_seq_length()


def install(state: object, tensors: Mapping[str, torch.Tensor], tokens: int, cover: range | None = None,
            start: int = 0) -> None:
    """Put verified ``tensors`` (positions ``start`` on) into ``state``: each of their layers must hold exactly
    ``start`` positions (none for a whole export; 409 otherwise, or when the token ids differ), and with them it
    must hold every block of ``cover`` (the layers the session runs afterwards)."""
    layers = sorted({int(name.split(".", 1)[1]) for name in tensors if name != "ids"})
    if isinstance(state, EmulatedKV):
        ids = tensors["ids"].tolist() if "ids" in tensors else None
        if ids is not None and state.ids and state.ids[:len(ids)] != ids:
            raise QuartError(409, "the export's token ids differ from the ones this replica holds", FIELD)
    taken = [layer for layer in layers if held_positions(state, layer) != start]
    if taken:
        raise QuartError(409, f"this replica holds other than {start} positions of layers {taken} of the session",
                         FIELD)
    missing = [layer for layer in cover or () if layer not in layers and not held_positions(state, layer)]
    if missing:
        raise QuartError(409, f"the session would lack the cache of layers {missing} it runs here", FIELD)
    for layer in layers:
        k, v = tensors[f"k.{layer}"], tensors[f"v.{layer}"]
        if isinstance(state, EmulatedKV):
            state.put(layer, k.to(state.dtype), v.to(state.dtype))
        else:
            cached = state.layers[layer - 1]
            cached.update(k, v)
            if hasattr(cached, "cumulative_length"):  # a sliding-window layer keeps its window, counts all
                cached.cumulative_length = tokens
    if isinstance(state, EmulatedKV) and ids is not None and not state.ids:
        state.ids = ids

