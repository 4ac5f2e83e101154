"""A parameter segment: a stage's tensors laid out in one shared-memory file (the KeysManager's host cache).

The layout is the stage's safetensors checkpoint without its header, each tensor 64-byte aligned, in file
order; a :class:`SegmentIndex` (JSON-able) says where each tensor lies. The KeysManager writes segments
(``keysmanager.shm_store``); a zygote, or a stage pod attaching to its node's cache (``quart_stage.attach``),
maps one with :func:`map_segment`: a private (copy-on-write) mapping of a file opened read-only, so the
segment is never written, every process that maps it shares the same physical pages, and ``fork`` does not
copy its page tables (a file-backed mapping with no anonymous page).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALIGN = 64

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
"""Bytes per element of every safetensors dtype a segment may hold."""


class SegmentError(ValueError):
    """A segment or its index is unusable (missing file, wrong size, slots outside it or overlapping)."""


@dataclass(frozen=True, slots=True)
class TensorSlot:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    offset: int  # in the segment
    nbytes: int


@dataclass(frozen=True, slots=True)
class SegmentIndex:
    path: str
    total_bytes: int
    tensors: tuple[TensorSlot, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "total_bytes": self.total_bytes,
                "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.tensors]}

    @classmethod
    def from_dict(cls, data: Any) -> SegmentIndex:
        """Parse and check an index (as :meth:`to_dict` writes it); raises SegmentError."""
        try:
            slots = tuple(TensorSlot(str(n), str(d), tuple(int(x) for x in shape), int(o), int(b))
                          for n, d, shape, o, b in data["tensors"])
            index = cls(str(data["path"]), int(data["total_bytes"]), slots)
        except (KeyError, TypeError, ValueError) as exc:
            raise SegmentError(f"malformed segment index: {exc!r}") from None
        index.check()
        return index

    def check(self) -> None:
        """Every slot a known dtype, its size equal to dtype x shape, aligned, inside the segment, no overlap."""
        end = 0
        for s in sorted(self.tensors, key=lambda s: s.offset):
            if s.dtype not in ITEMSIZE:
                raise SegmentError(f"tensor {s.name}: unsupported dtype {s.dtype}")
            if any(d < 0 for d in s.shape) or s.nbytes != math.prod(s.shape) * ITEMSIZE[s.dtype]:
                raise SegmentError(f"tensor {s.name}: {s.nbytes} bytes do not hold a {s.dtype} {list(s.shape)}")
            if s.offset % ALIGN or s.offset < end or s.offset + s.nbytes > self.total_bytes:
                raise SegmentError(f"tensor {s.name}: bytes [{s.offset}, {s.offset + s.nbytes}) overlap another "
                                   f"tensor, are unaligned or lie outside the {self.total_bytes}-byte segment")
            end = s.offset + s.nbytes


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > 100 << 20:
            raise ValueError(f"{path}: safetensors header of {header_len} bytes is not plausible")
        header = json.loads(f.read(header_len))
    return 8 + header_len, header


def layout(header: dict) -> tuple[list[tuple[TensorSlot, int]], int]:
    """Aligned slots for every tensor of a safetensors header, with each tensor's offset in the source."""
    slots: list[tuple[TensorSlot, int]] = []
    cursor = 0
    tensors = [(name, meta) for name, meta in header.items() if name != "__metadata__"]
    for name, meta in sorted(tensors, key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = meta["data_offsets"]
        if meta["dtype"] not in ITEMSIZE:
            raise ValueError(f"tensor {name}: unsupported dtype {meta['dtype']}")
        cursor = (cursor + ALIGN - 1) // ALIGN * ALIGN
        slots.append((TensorSlot(name, meta["dtype"], tuple(meta["shape"]), cursor, end - begin), begin))
        cursor += end - begin
    return slots, max(cursor, 1)


def map_segment(index: SegmentIndex) -> tuple[mmap.mmap, dict]:
    """Map a segment copy-on-write from a read-only descriptor; (the mapping, {name: tensor over it}).

    Touches no page. Raises SegmentError when the file is missing or not the index's size.
    """
    import torch

    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
              "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
    try:
        fd = os.open(index.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SegmentError(f"cannot open segment {index.path}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size != index.total_bytes:
            raise SegmentError(f"segment {index.path} has {size} bytes, its index says {index.total_bytes}")
        mm = mmap.mmap(fd, index.total_bytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    tensors = {}
    for slot in index.tensors:
        dtype = dtypes[slot.dtype]
        count = slot.nbytes // ITEMSIZE[slot.dtype]
        if count == 0:
            tensors[slot.name] = torch.empty(slot.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=slot.offset)
        tensors[slot.name] = flat.view(slot.shape)
    return mm, tensors
