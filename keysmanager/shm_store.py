"""Writing shared-memory parameter segments (the zygote's side) and the isolated mode's private copy.

The layout and the mapping are the stage runtime's (``quart_stage.segment``: a stage pod maps the same
segments). A zygote copies the stage's safetensors checkpoint into a segment (64-byte aligned tensors) and
maps it copy-on-write. Linux ``fork`` does not copy page tables of file-backed mappings that have no
anonymous pages, so forking a zygote that holds 4 GB costs about as much as forking one that holds 4 MB, and
every replica maps the same physical pages (PSS is split between them). A write by a replica gets a private
page (copy-on-write), never reaching the file. ``privatize`` makes a replica copy every page (isolated mode).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
from quart_stage.segment import SegmentIndex, layout, read_safetensors_header

PAGE = mmap.PAGESIZE
_COPY_CHUNK = 64 << 20


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


def privatize(mm: mmap.mmap) -> int:
    """Isolated mode: write every page of the copy-on-write mapping so the kernel gives us a private copy.

    Addresses do not change, so tensors over the mapping keep working. Returns the bytes copied.
    """
    pages = np.frombuffer(mm, dtype=np.uint8)
    touched = pages[::PAGE]
    touched[:] = touched.copy()  # a real write per page: the kernel copies each page (CoW break)
    return len(mm)
