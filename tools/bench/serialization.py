"""`quartctl bench serialization`: activation serialize + deserialize vs a plain memory copy.

For each size (1..64 MB of fp32 activations shaped [1, T, 4096]) it times, best of `--repeats`
(serde, copy and clone interleaved, so machine load affects them alike):
  serde : `wire.encode` (header + one copy into a fresh buffer) then `wire.decode` (validated, zero-copy);
  copy  : `ndarray.copy()` of the same bytes (a fresh buffer and one memcpy; the ratio's baseline);
  clone : `tensor.clone()` (torch's allocator; slower above ~32 MB, page faults), for reference;
  lib   : safetensors.torch.save + load (the library round trip), for reference.
Writes JSON ``{"machine": ..., "rows": [{mb, serde_gbps, copy_gbps, ratio, ...}]}``.
"""

from __future__ import annotations

import sys
import time

import torch
from quart_stage import cliargs, wire
from quart_tools.bench import machine_info, write_report

DEFAULT_SIZES_MB = (1, 2, 4, 8, 16, 32, 64)


def _best(fns, repeats: int) -> list[float]:
    """Best time of each function, measured interleaved (a, b, c, a, b, c, ...) so that load from other
    processes hits all of them alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def measure(mb: float, repeats: int = 20, hidden: int = 4096) -> dict:
    """One row: seconds and GB/s of serde, copy and the library round trip for `mb` MB of fp32."""
    numel = int(mb * (1 << 20)) // 4
    seq = max(1, numel // hidden)
    x = torch.randn(1, seq, hidden)
    nbytes = x.numel() * x.element_size()
    meta = {"model": "bench", "stage": "1"}

    def serde():
        d = wire.decode(wire.encode({"hidden_states": x}, meta))
        assert d.tensors["hidden_states"].shape == x.shape

    raw = x.view(-1).view(torch.uint8).numpy()

    def copy():
        raw.copy()  # a fresh buffer + memcpy, same allocator as encode (numpy)

    def clone():
        x.clone()

    def lib():
        from safetensors.torch import load, save

        load(save({"hidden_states": x}, meta))

    check = wire.decode(wire.encode({"hidden_states": x}, meta)).tensors["hidden_states"]
    if not torch.equal(check, x):
        raise AssertionError("wire round trip changed the data")
    for fn in (serde, copy):
        fn()  # warm up allocator and page tables
    t_serde, t_copy, t_clone = _best([serde, copy, clone], repeats)
    (t_lib,) = _best([lib], max(3, repeats // 4))
    gb = nbytes / 1e9
    return {"mb": round(nbytes / (1 << 20), 3), "serde_gbps": round(gb / t_serde, 3), "copy_gbps": round(gb / t_copy, 3),
            "ratio": round(t_copy / t_serde, 3), "torch_clone_gbps": round(gb / t_clone, 3), "library_gbps": round(gb / t_lib, 3),
            "serde_ms": round(t_serde * 1e3, 4), "copy_ms": round(t_copy * 1e3, 4), "library_ms": round(t_lib * 1e3, 4)}


def run(sizes_mb=DEFAULT_SIZES_MB, repeats: int = 20) -> dict:
    torch.set_num_threads(1)
    # big sizes are memory-bandwidth bound and stable: fewer repeats keep the run around a minute
    rows = [measure(mb, max(10, int(repeats * min(1.0, 8.0 / mb)))) for mb in sizes_mb]
    return {
        "benchmark": "serialization",
        "machine": machine_info(torch=torch.__version__, torch_threads=torch.get_num_threads()),
        "method": "best of repeats; serde = wire.encode + wire.decode; copy = ndarray.copy() of the bytes; ratio = copy_time / serde_time",
        "rows": rows,
    }


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench serialization", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write JSON here (default stdout)")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES_MB), help="MB, comma separated")
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    doc = run([float(s) for s in args.sizes.split(",") if s], args.repeats)
    write_report(doc, args.out)
    for r in doc["rows"]:
        print(f"{r['mb']:8.2f} MB  serde {r['serde_gbps']:7.2f} GB/s  copy {r['copy_gbps']:7.2f} GB/s  "
              f"ratio {r['ratio']:.2f}  (safetensors lib {r['library_gbps']:.2f} GB/s)", file=sys.stderr)
    return 0
