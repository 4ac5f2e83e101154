"""The shared-memory parameter store: a stage's tensors laid out in one file under /dev/shm.

A zygote copies the stage's safetensors checkpoint into a segment (64-byte aligned tensors) and builds
torch tensors over a private (copy-on-write) file-backed mapping of it. Linux ``fork`` does not copy page
tables of file-backed mappings that have no anonymous pages, so forking a zygote that holds 4 GB costs
about as much as forking one that holds 4 MB, and every replica maps the same physical pages (PSS is
split between them). A write by a replica gets a private page (copy-on-write), never reaching the file.
``privatize`` makes a replica copy every page (the isolated mode).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ALIGN = 64
PAGE = mmap.PAGESIZE
_COPY_CHUNK = 64 << 20

# safetensors dtype names -> numpy dtype used only for sizes; torch dtypes resolved lazily
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


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
    for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1):
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if meta["dtype"] not in _ITEMSIZE:
            raise ValueError(f"tensor {name}: unsupported dtype {meta['dtype']}")
        cursor = (cursor + ALIGN - 1) // ALIGN * ALIGN
        slots.append((TensorSlot(name, meta["dtype"], tuple(meta["shape"]), cursor, end - begin), begin))
        cursor += end - begin
    return slots, max(cursor, 1)


def write_segment(source: Path, dest: Path) -> SegmentIndex:
    """Copy a safetensors checkpoint into a new shared-memory segment ``dest`` (mode 0600)."""
    data_start, header = read_safetensors_header(source)
    slots, total = layout(header)
    free = os.statvfs(dest.parent).f_bavail * os.statvfs(dest.parent).f_frsize
    if free < total:
        raise MemoryError(f"{dest.parent} has {free} bytes free; the stage needs {total}")
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, total)
        with mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as out, open(source, "rb") as src:
            view = memoryview(out)
            for slot, src_offset in slots:
                src.seek(data_start + src_offset)
                done = 0
                while done < slot.nbytes:
                    n = min(_COPY_CHUNK, slot.nbytes - done)
                    got = src.readinto(view[slot.offset + done: slot.offset + done + n])
                    if not got:
                        raise ValueError(f"{source}: truncated tensor {slot.name}")
                    done += got
            view.release()
    except BaseException:
        os.close(fd)
        dest.unlink(missing_ok=True)
        raise
    os.close(fd)
    return SegmentIndex(str(dest), total, tuple(s for s, _ in slots))


def map_segment(index: SegmentIndex) -> tuple[mmap.mmap, dict]:
    """Map a segment copy-on-write and return (the mapping, {name: tensor over it}). Touches no page."""
    import torch

    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
              "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
    fd = os.open(index.path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, index.total_bytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    tensors = {}
    for slot in index.tensors:
        dtype = dtypes[slot.dtype]
        count = slot.nbytes // _ITEMSIZE[slot.dtype]
        if count == 0:
            tensors[slot.name] = torch.empty(slot.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=slot.offset)
        tensors[slot.name] = flat.view(slot.shape)
    return mm, tensors


def privatize(mm: mmap.mmap) -> int:
    """Isolated mode: write every page of the copy-on-write mapping so the kernel gives us a private copy.

    Addresses do not change, so tensors over the mapping keep working. Returns the bytes copied.
    """
    pages = np.frombuffer(mm, dtype=np.uint8)
    touched = pages[::PAGE]
    touched[:] = touched.copy()  # a real write per page: the kernel copies each page (CoW break)
    return len(mm)
