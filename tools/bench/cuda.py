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

import json
import mmap
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from quart_stage import cliargs
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


def make_segment(path: Path, disk_file: Path, nbytes: int) -> list[tuple[int, int]]:
    """A /dev/shm segment of fp16 tensors laid end to end, and the same tensors as a safetensors file on disk.

    Written with numpy: this process is the zygote of the forks measured later and must not have started
    torch's thread pools (a forked child of a process with an OpenMP pool hangs in its first parallel op)."""
    from safetensors.numpy import save_file

    shapes, tensors = _layer_shapes(nbytes), {}
    block = np.random.default_rng(0).standard_normal(TENSOR_BYTES // 2, dtype=np.float32).astype(np.float16)
    with open(path, "wb") as fh:  # one random block reused: the values do not matter to a copy
        for i, (rows, cols) in enumerate(shapes):
            tensors[f"w{i}"] = block[: rows * cols].reshape(rows, cols)
            fh.write(tensors[f"w{i}"].tobytes())
    save_file(tensors, str(disk_file))
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fork_once(path: Path, shapes: list[tuple[int, int]], method: str, device: torch.device) -> dict:
    """Fork a child that moves the mapped module to ``device``; the parent never initialises CUDA."""
    _mm, module = map_module(path, shapes)

    def replica(t0: float) -> dict:
        t_fork = time.perf_counter()
        torch.empty(1, device=device)  # CUDA context
        t_init = time.perf_counter()
        moved = move_module(module, device, method)
        _sync(device)
        t_done = time.perf_counter()
        return {"fork_ms": (t_fork - t0) * 1e3, "cuda_init_ms": (t_init - t_fork) * 1e3,
                "copy_ms": (t_done - t_init) * 1e3, "ready_ms": (t_done - t0) * 1e3, "bytes": moved,
                "ok": all(p.device == device or device.type == "cpu" for p in module.parameters())}

    return _in_child(replica, time.perf_counter())


_COLD = r"""
import json, os, sys, time
t0 = float(sys.argv[2])
import numpy as np
import torch
from safetensors.torch import load_file
t_import = time.perf_counter()
tensors = load_file(sys.argv[1])
t_read = time.perf_counter()
m = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in tensors.values()])
m.to(sys.argv[3])
if sys.argv[3].startswith("cuda"):
    torch.cuda.synchronize()
t_done = time.perf_counter()
print(json.dumps({"import_ms": (t_import - t0) * 1e3, "read_ms": (t_read - t_import) * 1e3,
                  "device_ms": (t_done - t_read) * 1e3, "ready_ms": (t_done - t0) * 1e3}))
"""


def _cold_once(disk_file: Path, device: torch.device) -> dict:
    with open(disk_file, "rb") as fh:  # drop the file's pages: the read comes from the disk
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _COLD, str(disk_file), repr(t0), str(device)], capture_output=True,
                         text=True, timeout=CHILD_TIMEOUT_S, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bandwidth(path: Path, shapes: list[tuple[int, int]], nbytes: int, repeats: int, device: torch.device) -> dict:
    """Best-of GB/s host→device for each source kind (runs in a child: the parent stays CUDA-free)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best: dict[str, float] = {}

    def timed(name: str, fn) -> None:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)

    pageable = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    pinned = pageable.pin_memory() if device.type == "cuda" else pageable.clone()
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


CHILD_TIMEOUT_S = 240.0


def _in_child(fn, *args) -> dict:
    """Run ``fn(*args)`` in a forked child and return its JSON (keeps CUDA out of this process). A child
    that fails or outlasts CHILD_TIMEOUT_S is killed and answers ``{"error": ...}``."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            try:
                out = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(write_fd, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks, deadline = [], time.monotonic() + CHILD_TIMEOUT_S
    with os.fdopen(read_fd, "rb", buffering=0) as fh:
        while True:
            ready, _, _ = select.select([fh], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return {"error": f"timed out after {CHILD_TIMEOUT_S:.0f} s"}
            chunk = fh.read(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    raw = b"".join(chunks)
    return json.loads(raw) if raw else {"error": "the child died without an answer"}


def run(sizes_gb: list[float], repeats: int, workdir: Path, device: torch.device) -> dict:
    rows = []
    for gb in sizes_gb:
        nbytes = int(gb * 1e9)
        seg = Path("/dev/shm") / f"quart-bench-cuda-{os.getpid()}"
        disk = workdir / "stage.safetensors"
        try:
            shapes = make_segment(seg, disk, nbytes)
            fork = {m: [_fork_once(seg, shapes, m, device) for _ in range(repeats)] for m in METHODS if m != "auto"}
            cold = [_cold_once(disk, device) for _ in range(max(1, repeats - 1))]
            bandwidth = _in_child(_bandwidth, seg, shapes, nbytes, repeats, device)
        finally:
            seg.unlink(missing_ok=True)
            disk.unlink(missing_ok=True)
        errors = sorted({f"{m}: {r['error']}" for m, runs in fork.items() for r in runs if "error" in r})
        if "error" in bandwidth:
            errors.append(f"bandwidth: {bandwidth.pop('error')}")
        fork = {m: [r for r in runs if "error" not in r] for m, runs in fork.items()}
        best_fork = {m: min(runs, key=lambda r: r["ready_ms"]) for m, runs in fork.items() if runs}
        best_cold = min(cold, key=lambda r: r["ready_ms"])
        staged = best_fork.get("staged", {"ready_ms": float("nan"), "copy_ms": float("nan")})
        rows.append({
            "gb": gb, "bytes": nbytes, "tensors": len(shapes), "bandwidth_gbps": bandwidth,
            "fork": {m: {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}
                     for m, r in best_fork.items()},
            "cold": {k: round(v, 1) for k, v in best_cold.items()},
            "cold_over_fork_staged": round(best_cold["ready_ms"] / staged["ready_ms"], 1),
            "pageable_over_staged_copy": round(best_fork["pageable"]["copy_ms"] / staged["copy_ms"], 2),
            "errors": errors,
        })
        print(json.dumps(rows[-1]), file=sys.stderr)
    return {"rows": rows}


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-gb", default="0.1,1,4", help="stage sizes in GB, comma separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write JSON here (default stdout)")
    p.add_argument("--device", default="cuda:0", help="cpu runs the same steps without a GPU (a smoke test)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    doc: dict = {"benchmark": "cuda", "machine": machine_info(torch=torch.__version__)}
    # asked in a child: the CUDA runtime's device query in this process would poison the forks measured below
    if device.type == "cuda" and not _in_child(lambda: {"cuda": torch.cuda.is_available()}).get("cuda"):
        doc.update({"cuda": False, "reason": "no CUDA device visible; nothing measured"})
        write_report(doc, args.out)
        return 0
    doc["cuda"] = device.type == "cuda"
    if doc["cuda"]:
        doc["gpu"] = _in_child(lambda: {"name": torch.cuda.get_device_name(0),
                                        "memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)})
    with tempfile.TemporaryDirectory(prefix="quart-bench-cuda-", dir=os.environ.get("QUART_BENCH_DISK")) as tmp:
        doc.update(run([float(s) for s in args.sizes_gb.split(",") if s], args.repeats, Path(tmp), device))
    write_report(doc, args.out)
    return 0
