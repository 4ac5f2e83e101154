"""`quartctl bench cuda`: the CUDA half of a replica start — fork, then parameters onto the device.

On a machine with a CUDA GPU, for each stage size (default 0.1, 1 and 4 GB of fp16 layer tensors of
64 MB at most):

- ``bandwidth``: host→device copy of the same bytes from pageable malloc'd memory, from a fresh
  copy-on-write mapping of a /dev/shm segment (what a forked replica holds: its page tables start
  empty, so the copy also pays the page faults), from pinned memory, and with the two better methods
  of ``quart_stage.device_copy`` (``staged`` through pinned buffers, ``register`` page-locking the
  mapping in place) — best of ``--repeats``, GB/s.
- ``fork``: a zygote (this process: torch imported, the segment mapped, CUDA never touched) forks a
  child that initialises CUDA and moves a module over the mapping onto the GPU with each method;
  ``ready_ms`` is fork → all parameters on the device (synchronised), split into ``cuda_init_ms`` and
  ``copy_ms``. ``cold`` is a fresh interpreter that imports torch, reads the stage from a disk file
  whose page cache was dropped (fsync + POSIX_FADV_DONTNEED) and moves it with ``module.to``: what a
  replica without the KeysManager does.

Without CUDA it reports ``{"cuda": false}`` and exits 0 (CI runs no GPU). docs/benchmarks.md, CUDA path.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from quart_stage.device_copy import METHODS, move_module
from quart_tools.bench import machine_info, write_report
from torch import nn

TENSOR_BYTES = 64 << 20  # one fp16 4096 x 8192 weight


def _layer_shapes(nbytes: int) -> list[tuple[int, int]]:
    """fp16 [rows, 8192] tensors of at most 64 MB adding up to ``nbytes``."""
    shapes, left = [], nbytes
    while left > 0:
        take = min(TENSOR_BYTES, left)
        shapes.append((max(1, take // (2 * 8192)), 8192))
        left -= take
    return shapes


def make_segment(path: Path, nbytes: int) -> list[tuple[int, int]]:
    """A /dev/shm segment of fp16 tensors laid end to end (random bytes, written once)."""
    shapes = _layer_shapes(nbytes)
    with open(path, "wb") as fh:
        for rows, cols in shapes:
            fh.write(torch.randn(rows, cols, dtype=torch.float16).numpy().tobytes())
    return shapes


def map_module(path: Path, shapes: list[tuple[int, int]]) -> tuple[mmap.mmap, nn.Module]:
    """A module whose parameters view a fresh copy-on-write mapping of the segment (as a zygote has)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, os.path.getsize(path), access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    params, offset = nn.ParameterList(), 0
    for rows, cols in shapes:
        t = torch.frombuffer(mm, dtype=torch.float16, count=rows * cols, offset=offset).view(rows, cols)
        params.append(nn.Parameter(t, requires_grad=False))
        offset += rows * cols * 2
    return mm, params


def _fork_once(path: Path, shapes: list[tuple[int, int]], method: str) -> dict:
    """Fork a child that moves the mapped module to cuda:0; the parent never initialises CUDA."""
    _mm, module = map_module(path, shapes)
    read_fd, write_fd = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the replica
        try:
            os.close(read_fd)
            t_fork = time.perf_counter()
            torch.cuda.init()
            device = torch.device("cuda:0")
            torch.empty(1, device=device)
            t_init = time.perf_counter()
            moved = move_module(module, device, method)
            torch.cuda.synchronize(device)
            t_done = time.perf_counter()
            ok = all(p.device.type == "cuda" for p in module.parameters())
            os.write(write_fd, json.dumps({"fork_ms": (t_fork - t0) * 1e3, "cuda_init_ms": (t_init - t_fork) * 1e3,
                                           "copy_ms": (t_done - t_init) * 1e3, "ready_ms": (t_done - t0) * 1e3,
                                           "bytes": moved, "ok": ok}).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        raw = fh.read()
    os.waitpid(pid, 0)
    return json.loads(raw)


_COLD = r"""
import json, os, sys, time
t0 = float(sys.argv[2])
import torch
from safetensors.torch import load_file
t_import = time.perf_counter()
tensors = load_file(sys.argv[1])
t_read = time.perf_counter()
m = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in tensors.values()])
m.to("cuda:0"); torch.cuda.synchronize()
t_done = time.perf_counter()
print(json.dumps({"import_ms": (t_import - t0) * 1e3, "read_ms": (t_read - t_import) * 1e3,
                  "device_ms": (t_done - t_read) * 1e3, "ready_ms": (t_done - t0) * 1e3}))
"""


def _cold_once(disk_file: Path) -> dict:
    with open(disk_file, "rb") as fh:  # drop the file's pages: the read comes from the disk
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _COLD, str(disk_file), repr(t0)], capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bandwidth(path: Path, shapes: list[tuple[int, int]], nbytes: int, repeats: int) -> dict:
    """Best-of GB/s host→device for each source kind (runs in a child: the parent stays CUDA-free)."""
    device = torch.device("cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best: dict[str, float] = {}

    def timed(name: str, fn) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)

    pageable = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    pinned = pageable.pin_memory()
    for _ in range(repeats):
        timed("pageable_malloc", lambda: dst.copy_(pageable))
        timed("pinned", lambda: dst.copy_(pinned, non_blocking=True))
        _mm, module = map_module(path, shapes)
        flat = [p.detach().reshape(-1).view(torch.uint8) for p in module.parameters()]
        timed("pageable_shm_first_touch", lambda flat=flat: [dst[: f.numel()].copy_(f) for f in flat])
        for method in ("staged", "register"):
            _mm, module = map_module(path, shapes)
            timed(f"{method}_shm_first_touch", lambda module=module, method=method: move_module(module, device, method))
    return {k: round(nbytes / v / 1e9, 2) for k, v in best.items()}


def _in_child(fn, *args) -> dict:
    """Run ``fn(*args)`` in a forked child and return its JSON (keeps CUDA out of this process)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.write(write_fd, json.dumps(fn(*args)).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        raw = fh.read()
    os.waitpid(pid, 0)
    return json.loads(raw)


def run(sizes_gb: list[float], repeats: int, workdir: Path) -> dict:
    from safetensors.torch import save_file

    rows = []
    for gb in sizes_gb:
        nbytes = int(gb * 1e9)
        seg = Path("/dev/shm") / f"quart-bench-cuda-{os.getpid()}"
        disk = workdir / "stage.safetensors"
        try:
            shapes = make_segment(seg, nbytes)
            _mm, module = map_module(seg, shapes)
            save_file({f"w{i}": p.detach().clone() for i, p in enumerate(module.parameters())}, str(disk))
            del module, _mm
            fork = {m: [_fork_once(seg, shapes, m) for _ in range(repeats)] for m in METHODS}
            cold = [_cold_once(disk) for _ in range(max(1, repeats - 1))]
            bandwidth = _in_child(_bandwidth, seg, shapes, nbytes, repeats)
        finally:
            seg.unlink(missing_ok=True)
            disk.unlink(missing_ok=True)
        best_fork = {m: min(runs, key=lambda r: r["ready_ms"]) for m, runs in fork.items()}
        best_cold = min(cold, key=lambda r: r["ready_ms"])
        rows.append({
            "gb": gb, "bytes": nbytes, "tensors": len(shapes), "bandwidth_gbps": bandwidth,
            "fork": {m: {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}
                     for m, r in best_fork.items()},
            "cold": {k: round(v, 1) for k, v in best_cold.items()},
            "cold_over_fork_staged": round(best_cold["ready_ms"] / best_fork["staged"]["ready_ms"], 1),
            "pageable_over_staged_copy": round(best_fork["pageable"]["copy_ms"] / best_fork["staged"]["copy_ms"], 2),
        })
        print(json.dumps(rows[-1]), file=sys.stderr)
    return {"rows": rows}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="quartctl bench cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-gb", default="0.1,1,4", help="stage sizes in GB, comma separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write JSON here (default stdout)")
    args = p.parse_args(argv)
    doc: dict = {"benchmark": "cuda", "machine": machine_info(torch=torch.__version__)}
    # asked in a child: the CUDA runtime's device query in this process would poison the forks measured below
    if not _in_child(lambda: {"cuda": torch.cuda.is_available()})["cuda"]:
        doc.update({"cuda": False, "reason": "no CUDA device visible; nothing measured"})
        write_report(doc, args.out)
        return 0
    doc["cuda"] = True
    with tempfile.TemporaryDirectory(prefix="quart-bench-cuda-") as tmp:
        doc.update(run([float(s) for s in args.sizes_gb.split(",") if s], args.repeats, Path(tmp)))
    doc["gpu"] = _in_child(lambda: {"name": torch.cuda.get_device_name(0),
                                    "memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)})
    write_report(doc, args.out)
    return 0
