"""The wire of a batched decode step (docs/generation.md#batched-decode-steps): no torch, the gateway uses it too.

A batched step is ``POST /`` with ``X-Quart-Session-Batch: <n>`` and a safetensors body: one tensor of ``n``
rows of one position each (stage 0: ``input_ids`` ``[n, 1]``; later stages: ``hidden_states`` ``[n, 1, H]``)
and the metadata key ``sessions``: a JSON list of ``n`` entries ``{"id", "pos", "end"?, "sample"?}``, row ``i``
belonging to entry ``i``. The answer carries ``results``: one entry per session, in the same order,
``{"id", "status": 200, "pos"[, "token"]}`` or ``{"id", "status", "error", "field"[, "held"]}``; a stage before
the last answers the rows of the sessions that succeeded (in order) as ``hidden_states`` with ``results`` in
the metadata, the last stage answers JSON ``{"results": [...]}``.

Here: the table (:class:`BatchEntry`, :func:`parse_table`) and row packing / splitting of safetensors bytes
(:func:`pack_rows`, :func:`split_rows`) without decoding a tensor.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from quart_stage.errors import invalid

H_SESSION_BATCH = "X-Quart-Session-Batch"
FIELD = "batch"
META_SESSIONS, META_RESULTS = "sessions", "results"
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}
_ALIGN = 8


@dataclass(frozen=True)
class BatchEntry:
    """One session's decode step in a batch: its id, the positions its replica holds, whether this is its last
    step, and (last stage) how to sample."""

    id: str
    pos: int
    end: bool = False
    sample: Mapping = field(default_factory=dict)

    def doc(self) -> dict:
        out: dict = {"id": self.id, "pos": self.pos}
        if self.end:
            out["end"] = 1
        if self.sample:
            out["sample"] = dict(self.sample)
        return out


def parse_count(raw: str, most: int) -> int:
    """``X-Quart-Session-Batch``: 1..most sessions; 400 ``batch`` otherwise."""
    text = raw.strip()
    if not text.isdigit() or len(text) > 6 or not 1 <= int(text) <= most:
        raise invalid(FIELD, f"{H_SESSION_BATCH} must be a session count from 1 to {most} "
                             f"(QUART_MAX_BATCH), got {raw[:40]!r}")
    return int(text)


def parse_table(raw: str | None, count: int) -> list[BatchEntry]:
    """The ``sessions`` metadata of a batched step: ``count`` decode steps of distinct sessions; 400 ``batch``."""
    try:
        doc = json.loads(raw) if raw is not None else None
    except ValueError:
        doc = None
    if not isinstance(doc, list) or len(doc) != count:
        raise invalid(FIELD, f"a batched step's metadata {META_SESSIONS!r} must be a JSON list of {count} "
                             'entries like {"id": "s1", "pos": 7}')
    out, seen = [], set()
    for k, e in enumerate(doc):
        if not isinstance(e, dict) or set(e) - {"id", "pos", "end", "sample"}:
            raise invalid(FIELD, f"session entry {k} must be an object with id, pos, end, sample")
        sid, pos, end, sample = e.get("id"), e.get("pos"), e.get("end", 0), e.get("sample", {})
        if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid):
            raise invalid(FIELD, f"session entry {k}: id must be 1..128 characters of A-Z a-z 0-9 . _ : -")
        if sid in seen:
            raise invalid(FIELD, f"session {sid!r} appears twice in one batch")
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 1:
            raise invalid(FIELD, f"session entry {k}: pos must be an integer >= 1 (a batch carries decode steps; "
                                 "a prefill goes alone)")
        if end not in (0, 1) or isinstance(end, float) or not isinstance(sample, dict):
            raise invalid(FIELD, f"session entry {k}: end must be 0 or 1 and sample an object")
        seen.add(sid)
        out.append(BatchEntry(sid, pos, bool(end), sample))
    return out


def read_header(body: bytes | memoryview) -> tuple[dict, int]:
    """The JSON header of a safetensors body and where its data starts; ValueError when it is not one."""
    if len(body) < 8:
        raise ValueError("too short for safetensors")
    (n,) = struct.unpack("<Q", bytes(body[:8]))
    if n > len(body) - 8 or n > 1 << 20:
        raise ValueError("safetensors header runs past the body")
    return json.loads(bytes(body[8 : 8 + n])), 8 + n


def pack_rows(name: str, dtype: str, row_shape: Sequence[int], rows: Sequence[bytes], metadata: Mapping[str, str]
              ) -> bytes:
    """One safetensors body: tensor ``name`` of shape ``[len(rows), *row_shape]`` from each row's raw bytes."""
    data = b"".join(rows)
    head = {name: {"dtype": dtype, "shape": [len(rows), *row_shape], "data_offsets": [0, len(data)]},
            "__metadata__": dict(metadata)}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return struct.pack("<Q", len(text)) + text + data


def split_rows(body: bytes, name: str) -> tuple[list[bytes], str, list[int], dict]:
    """The rows of tensor ``name`` (raw bytes each), its dtype, one row's shape, and the metadata."""
    head, start = read_header(body)
    entry = head.get(name)
    if not isinstance(entry, dict) or entry.get("dtype") not in ITEMSIZE:
        raise ValueError(f"the answer has no {name} tensor of a known dtype")
    shape, (lo, hi) = list(entry["shape"]), entry["data_offsets"]
    rows = shape[0] if shape else 0
    if hi - lo != rows * _count(shape[1:]) * ITEMSIZE[entry["dtype"]] or start + hi > len(body):
        raise ValueError(f"the {name} tensor's bytes do not match its shape")
    width = (hi - lo) // rows if rows else 0
    data = body[start + lo : start + hi]
    return [data[i * width : (i + 1) * width] for i in range(rows)], entry["dtype"], shape[1:], head.get(
        "__metadata__", {})


def _count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
