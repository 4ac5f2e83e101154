"""Moving a stage's parameters from host memory onto its device after a fork (the CUDA half of a start).

A forked replica's parameters are pages of the KeysManager's shared-memory segment: ordinary pageable
host memory. ``tensor.to("cuda")`` from pageable memory makes the CUDA driver copy each tensor through
its own small pinned bounce buffer, synchronously, one tensor after the other. Two ways do better:

- ``staged``: two pinned staging buffers (``chunk_bytes_for`` the stage's size each); while the GPU's copy engine moves
  chunk k from one buffer, the CPU fills the other with chunk k+1. Bounded by the slower of the host
  memcpy and the host→device link; costs 2 × chunk_bytes of pinned memory for the copy's duration.
- ``register``: page-lock the segment where it is (``cudaHostRegister``, read-only) and let the copy
  engine read it directly; pays the page-locking of the whole stage first.
- ``pageable``: ``module.to(device)``, the baseline.
- ``auto`` (default): ``staged`` for a stage of at least ``STAGED_FROM_BYTES``, else ``pageable``.

``quartctl bench cuda`` measures them side by side (docs/benchmarks.md, CUDA path: on an H100, 4 GB
moved in 164 ms staged vs 686 ms pageable; below 1 GB pageable was as fast or faster, and ``register``
was slowest everywhere: page-locking a copy-on-write mapping costs more than the copy). The stage's
``QUART_DEVICE_COPY`` picks one. On a CPU device every method is a plain ``.to``.
"""

from __future__ import annotations

import torch
from torch import nn

from quart_stage.config import DEVICE_COPY_METHODS as METHODS

STAGED_FROM_BYTES = 1 << 30
MAX_CHUNK_BYTES = 64 << 20
MIN_CHUNK_BYTES = 4 << 20


def chunk_bytes_for(total_bytes: int) -> int:
    """Staging buffer size: a sixteenth of the stage within [4 MB, 64 MB] (pinned buffers cost time to
    allocate: two of 64 MB made a 0.1 GB stage slower staged than pageable on an H100)."""
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, total_bytes // 16))
_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads; no copy-on-write faults


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every distinct parameter and buffer tensor of ``module`` (shared ones once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def staged_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], chunk_bytes: int = 0) -> int:
    """Copy each host ``src`` into its device ``dst`` through two pinned staging buffers, overlapping the
    host memcpy of one chunk with the device copy of the other. Returns the bytes copied."""
    if not pairs:
        return 0
    chunk_bytes = chunk_bytes or chunk_bytes_for(sum(src.nbytes for src, _ in pairs))
    device = pairs[0][1].device
    on_cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if on_cuda else None
    buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(2)]
    in_use: list[torch.cuda.Event | None] = [None, None]
    turn = total = 0
    for src, dst in pairs:
        s, d = _bytes(src.contiguous()), _bytes(dst)
        n, done = s.numel(), 0
        while done < n:
            k = turn % 2
            m = min(chunk_bytes, n - done)
            if in_use[k] is not None:
                in_use[k].synchronize()  # the device has finished reading this buffer
            buffers[k][:m].copy_(s[done:done + m])
            if stream is not None:
                with torch.cuda.stream(stream):
                    d[done:done + m].copy_(buffers[k][:m], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                in_use[k] = event
            else:
                d[done:done + m].copy_(buffers[k][:m])
            done += m
            turn += 1
        total += n
    if stream is not None:
        stream.synchronize()
    return total


def registered_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Page-lock each source's memory in place (read-only), copy asynchronously, unregister."""
    if not pairs or pairs[0][1].device.type != "cuda":
        for src, dst in pairs:
            dst.copy_(src)
        return sum(src.nbytes for src, _ in pairs)
    cudart = torch.cuda.cudart()
    registered: list[int] = []
    try:
        for src, _ in pairs:  # a source that cannot be registered is copied as pageable memory
            if src.nbytes and int(cudart.cudaHostRegister(src.data_ptr(), src.nbytes, _REGISTER_READ_ONLY)) == 0:
                registered.append(src.data_ptr())
        for src, dst in pairs:
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(pairs[0][1].device)
    finally:
        for ptr in registered:
            cudart.cudaHostUnregister(ptr)
    return sum(src.nbytes for src, _ in pairs)


def move_module(module: nn.Module, device: torch.device, method: str = "staged",
                chunk_bytes: int = 0) -> int:
    """Move every parameter and buffer of ``module`` to ``device`` by ``method``; returns bytes moved."""
    if method not in METHODS:
        raise ValueError(f"device copy method must be one of {', '.join(METHODS)}, got {method!r}")
    nbytes = sum(t.nbytes for t in _tensors(module))
    if method == "auto":
        method = "staged" if nbytes >= STAGED_FROM_BYTES else "pageable"
    if method == "pageable" or device.type == "cpu":
        module.to(device)
        return nbytes
    sources = [t for t in _tensors(module) if t.device.type == "cpu"]
    targets = {id(t): torch.empty(t.shape, dtype=t.dtype, device=device) for t in sources}
    pairs = [(t, targets[id(t)]) for t in sources]
    moved = staged_copy(pairs, chunk_bytes) if method == "staged" else registered_copy(pairs)
    module._apply(lambda t: targets.get(id(t), t))
    return moved
