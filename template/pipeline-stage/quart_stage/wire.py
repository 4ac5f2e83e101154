"""Activation wire format: safetensors bytes, decoded without copying and encoded with one copy.

Layout (the safetensors format): 8-byte little-endian header length N, N bytes of JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then the
tensor bytes. `decode` validates everything the header claims against the body before any tensor is
created (a lying header is a 400, never a crash or an over-read) and returns tensors that view the
received buffer (``torch.frombuffer``). `encode` writes the header and copies each tensor once into
one uninitialised buffer; `encode_chunks` gives the same bytes as a list of `bytes` for WSGI servers.
Never pickle.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring as _quote  # C-accelerated JSON string escape

import numpy as np
import torch

from quart_stage import jsonparse
from quart_stage.errors import invalid

CONTENT_TYPE = "application/octet-stream"
MAX_HEADER_BYTES = 1 << 20
ALIGN = 64
"""Header padding: tensor data starts 64-byte aligned (cache line; safetensors needs 8), which memcpy likes."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32,
}


@dataclass
class Decoded:
    """Tensors (views of the received buffer) and the string metadata of one message."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def header_bytes(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
                 ) -> tuple[bytes, int]:
    """The 8-byte length + padded JSON header for tensors of the given (dtype, shape); and the body length.

    Built by string formatting with the C string escaper (`json.encoder.encode_basestring`): this runs
    per request and is a visible share of the cost of a 1 MB activation.
    """
    return _header_from(((name, dtype, shape) for name, (dtype, shape) in specs.items()), metadata)


def _header_from(items, metadata: Mapping[str, str] | None) -> tuple[bytes, int]:
    parts = []
    if metadata:
        parts.append('"__metadata__":{' + ",".join(
            _quote(str(k)) + ":" + _quote(str(v)) for k, v in metadata.items()) + "}")
    offset = 0
    for name, dtype, shape in items:
        code = DTYPE_CODES.get(dtype)
        if code is None:
            raise TypeError(f"tensor {name!r} has dtype {dtype}, which the wire format does not carry")
        nbytes = ITEMSIZE[code]
        for d in shape:
            nbytes *= d
        parts.append(f'{_quote(name)}:{{"dtype":"{code}","shape":[{",".join(map(str, shape))}],'
                     f'"data_offsets":[{offset},{offset + nbytes}]}}')
        offset += nbytes
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # pad so the body starts aligned (the safetensors writer pads to 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> tuple[bytes, int]:
    return _header_from(((n, t.dtype, t.shape) for n, t in tensors.items()), metadata)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `t` on the CPU (copies only when `t` is on a device or not contiguous)."""
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(-1).view(torch.uint8)


_NUMPY_SAFE = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
               torch.uint8, torch.bool}


def _byte_array(t: torch.Tensor) -> np.ndarray:
    """`byte_view(t)` as a numpy array; the common case (contiguous CPU tensor) without torch view calls."""
    if t.dtype in _NUMPY_SAFE and not t.requires_grad and t.device.type == "cpu" and t.is_contiguous():
        return t.numpy().view(np.uint8).reshape(-1)
    return byte_view(t).numpy()


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> memoryview:
    """Serialize to one contiguous buffer (header + one copy of each tensor's bytes)."""
    head, body_len = _header(tensors, metadata)
    out = np.empty(len(head) + body_len, dtype=np.uint8)  # uninitialised: every byte is written below
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    pos = len(head)
    for t in tensors.values():
        src = _byte_array(t)
        out[pos : pos + src.size] = src  # numpy memcpy: fast at any offset (torch's copy_ is not, unaligned)
        pos += src.size
    return memoryview(out)


def encode_chunks(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> list[bytes]:
    """The same bytes as `encode`, as `bytes` chunks (what WSGI servers accept), one copy per tensor."""
    head, _ = _header(tensors, metadata)
    return [head, *(_byte_array(t).tobytes() for t in tensors.values())]


def encode_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Convenience for clients: one `bytes` object."""
    return b"".join(encode_chunks(tensors, metadata))


def decode(buf: bytes | bytearray | memoryview, field: str = "body") -> Decoded:
    """Parse and validate safetensors bytes; tensors view `buf` (no copy). Raises QuartError."""
    view = memoryview(buf).cast("B")
    total = len(view)
    if total < 8:
        raise invalid(field, f"body is truncated: {total} bytes, a safetensors message needs at least 8")
    (header_len,) = struct.unpack_from("<Q", view, 0)
    if header_len > MAX_HEADER_BYTES:
        raise invalid(field, f"safetensors header claims {header_len} bytes (limit {MAX_HEADER_BYTES})")
    if 8 + header_len > total:
        raise invalid(field, f"body is truncated: header claims {header_len} bytes but only {total - 8} follow")
    header = jsonparse.loads(view[8 : 8 + header_len], field, "safetensors header")  # a nested one: 400
    if not isinstance(header, dict):
        raise invalid(field, "safetensors header must be a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise invalid("__metadata__", "safetensors metadata must map strings to strings")
    body_start = 8 + header_len
    body_len = total - body_start
    spans = []
    for name, entry in header.items():
        spans.append((_check_entry(name, entry), name, entry))
    spans.sort()
    expected = 0
    for (begin, end), name, _ in spans:
        if begin != expected:
            raise invalid(name, f"data_offsets start at {begin}, expected {expected} (gaps or overlaps)")
        expected = end
    if expected != body_len:
        if expected > body_len:
            raise invalid(field, f"body is truncated: header describes {expected} data bytes, {body_len} present")
        raise invalid(field, f"body has {body_len - expected} bytes beyond what the header describes")
    writable = not view.readonly
    tensors: dict[str, torch.Tensor] = {}
    for (begin, end), name, entry in spans:
        dtype = DTYPES[entry["dtype"]]
        shape = entry["shape"]
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        if writable:
            flat = torch.frombuffer(view, dtype=torch.uint8, count=end - begin, offset=body_start + begin)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only views are fine: stages never write inputs
                flat = torch.frombuffer(view, dtype=torch.uint8, count=end - begin, offset=body_start + begin)
        if flat.data_ptr() % ITEMSIZE[entry["dtype"]]:
            flat = flat.clone()  # misaligned sender: one copy keeps every kernel safe
        tensors[name] = flat.view(dtype).view(shape)
    return Decoded(tensors, {str(k): v for k, v in metadata.items()})


def _check_entry(name: str, entry) -> tuple[int, int]:
    if not isinstance(entry, dict):
        raise invalid(name, "tensor entry must be an object with dtype, shape, data_offsets")
    dtype = entry.get("dtype")
    if dtype not in DTYPES:
        raise invalid(name, f"dtype {dtype!r} is not supported; one of {', '.join(DTYPES)}")
    shape = entry.get("shape")
    if type(shape) is not list:
        raise invalid(name, "shape must be a list of non-negative integers")
    nbytes = ITEMSIZE[dtype]
    for d in shape:
        if type(d) is not int or d < 0:  # type() rather than isinstance(): JSON true is not a dimension
            raise invalid(name, "shape must be a list of non-negative integers")
        nbytes *= d
    offsets = entry.get("data_offsets")
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
            or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1]):
        raise invalid(name, "data_offsets must be [begin, end] with 0 <= begin <= end")
    if offsets[1] - offsets[0] != nbytes:
        raise invalid(
            name, f"header lies: shape {shape} of {dtype} needs {nbytes} bytes, data_offsets span "
            f"{offsets[1] - offsets[0]}")
    return offsets[0], offsets[1]
