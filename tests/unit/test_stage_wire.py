"""The activation wire format: safetensors-compatible, zero-copy decode, strict validation."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from quart_stage import wire
from quart_stage.errors import QuartError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def _raw(header: dict, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                                   torch.uint8, torch.bool, torch.float64])
def test_round_trip_every_dtype_and_library_compat(dtype):
    x = (torch.arange(24) % 5).reshape(2, 3, 4).to(dtype)
    tensors = {"a": x, "b": torch.ones(3, dtype=torch.float32)}
    ours = wire.encode_bytes(tensors, {"model": "m"})
    assert bytes(wire.encode(tensors, {"model": "m"})) == ours
    back = st_load(ours)  # the safetensors library reads our bytes
    assert torch.equal(back["a"], x) and torch.equal(back["b"], tensors["b"])
    decoded = wire.decode(st_save(tensors, {"model": "m"}))  # and we read the library's
    assert torch.equal(decoded.tensors["a"], x) and decoded.metadata == {"model": "m"}


def test_decode_is_zero_copy_and_body_is_aligned():
    buf = bytearray(wire.encode_bytes({"h": torch.randn(4, 8)}))
    t = wire.decode(buf).tensors["h"]
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert base <= t.data_ptr() < base + len(buf)
    assert (t.data_ptr() - base) % wire.ALIGN == 0
    buf[-4:] = struct.pack("<f", 42.0)  # the tensor views the buffer
    assert t.reshape(-1)[-1].item() == 42.0


def test_misaligned_body_is_copied_correctly():
    x = torch.arange(6, dtype=torch.float32)
    header = json.dumps({"x": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}}).encode() + b" "
    raw = struct.pack("<Q", len(header)) + header + x.numpy().tobytes()
    assert (8 + len(header)) % 4  # deliberately misaligned
    assert torch.equal(wire.decode(raw).tensors["x"], x)


def test_empty_tensor_and_metadata_only():
    d = wire.decode(wire.encode_bytes({"e": torch.zeros(0, 3)}, {"k": "v"}))
    assert d.tensors["e"].shape == (0, 3) and d.metadata == {"k": "v"}


BAD = [
    ("short", b"\x01\x02", "body", "truncated"),
    ("header longer than body", struct.pack("<Q", 100) + b"{}", "body", "truncated"),
    ("huge header", struct.pack("<Q", 1 << 40) + b"{}", "body", "header claims"),
    ("not json", struct.pack("<Q", 3) + b"abc", "body", "not valid JSON"),
    ("not an object", _raw([1, 2], b""), "body", "JSON object"),
    ("bad dtype", _raw({"x": {"dtype": "F8", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "x", "dtype"),
    ("negative dim", _raw({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0"), "x", "shape"),
    ("bool dim", _raw({"x": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"), "x", "shape"),
    ("offsets reversed", _raw({"x": {"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}}, b"\0"), "x", "data_offsets"),
    ("header lies", _raw({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8), "x", "lies"),
    ("gap", _raw({"x": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"\0\0"), "x", "expected 0"),
    ("overlap", _raw({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                      "y": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3), "y", "overlaps"),
    ("truncated body", _raw({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 15), "body",
     "truncated"),
    ("trailing bytes", _raw({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0\0"), "body", "beyond"),
    ("metadata not strings", _raw({"__metadata__": {"a": 1}}, b""), "__metadata__", "strings"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_decode_rejects_with_the_field_named(case):
    _, raw, field, words = case
    with pytest.raises(QuartError) as info:
        wire.decode(raw)
    assert info.value.field == field
    assert words in info.value.message
    assert info.value.status == 400
