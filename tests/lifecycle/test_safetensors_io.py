"""Deterministic safetensors writer and one-buffer reader: interoperable with the `safetensors` package."""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4flash.lifecycle.errors import AdapterFormatError
from dsv4flash.lifecycle.safetensors_io import read_header, read_safetensors, write_safetensors

TENSORS = {
    "b.bf16": torch.arange(6, dtype=torch.float32).to(torch.bfloat16).view(2, 3),
    "a.f32": torch.linspace(-1, 1, 5),
    "c.i8": torch.tensor([1, -2, 3], dtype=torch.int8),
    "d.f8": torch.tensor([0.5, 2.0], dtype=torch.float32).to(torch.float8_e4m3fn),
    "e.empty": torch.zeros(0, 4),
}


def _write(path, tensors, meta=None):
    with open(path, "wb") as f:
        return write_safetensors(f, tensors, meta)


def test_our_files_load_in_safetensors_and_back(tmp_path):
    n = _write(tmp_path / "x.safetensors", TENSORS, {"k": "v"})
    assert n == (tmp_path / "x.safetensors").stat().st_size
    theirs = load_file(tmp_path / "x.safetensors")
    ours, header = read_safetensors(tmp_path / "x.safetensors", threads=2, chunk=7)
    assert header.metadata == {"k": "v"}
    for name, t in TENSORS.items():
        assert theirs[name].dtype == ours[name].dtype == t.dtype
        assert torch.equal(theirs[name].view(torch.uint8), t.view(torch.uint8))
        assert torch.equal(ours[name].view(torch.uint8), t.view(torch.uint8))


def test_we_read_files_written_by_safetensors(tmp_path):
    save_file({k: v for k, v in TENSORS.items() if v.numel()}, tmp_path / "y.safetensors")
    ours, _ = read_safetensors(tmp_path / "y.safetensors")
    assert torch.equal(ours["b.bf16"], TENSORS["b.bf16"]) and torch.equal(ours["a.f32"], TENSORS["a.f32"])


def test_foreign_order_and_unaligned_offsets_read_right(tmp_path):
    """Tensors are views per run of one dtype: a file that interleaves dtypes, or puts a float32 at an odd
    offset (another writer's layout, not ours), still reads every tensor right."""
    import json
    import struct

    parts = [("c", "I8", [3], torch.tensor([1, -2, 3], dtype=torch.int8)),
             ("a", "F32", [2, 1], torch.tensor([[1.5], [-2.0]])),  # starts at byte 3: unaligned
             ("b", "F32", [0], torch.zeros(0)), ("z", "F32", [], torch.tensor(7.0)),
             ("h", "BF16", [2], torch.tensor([0.5, 4.0]).to(torch.bfloat16)),
             ("y", "F32", [1], torch.tensor([9.0]))]
    header, data = {}, b""
    for name, dtype, shape, t in parts:
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    blob = json.dumps(header).encode()
    (tmp_path / "f.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    ours, _ = read_safetensors(tmp_path / "f.safetensors")
    for name, _, shape, t in parts:
        assert ours[name].dtype == t.dtype and list(ours[name].shape) == shape and torch.equal(ours[name], t), name


def test_bytes_are_deterministic_regardless_of_dict_order():
    a, b = io.BytesIO(), io.BytesIO()
    write_safetensors(a, TENSORS)
    write_safetensors(b, dict(reversed(list(TENSORS.items()))))
    assert a.getvalue() == b.getvalue()


def test_hash_callback_sees_every_byte(tmp_path):
    _write(tmp_path / "z.safetensors", TENSORS)
    seen = bytearray()
    read_safetensors(tmp_path / "z.safetensors", on_chunk=lambda v: seen.extend(v), chunk=5)
    assert bytes(seen) == (tmp_path / "z.safetensors").read_bytes()


def test_truncated_and_garbage_files_name_the_file(tmp_path):
    path = tmp_path / "t.safetensors"
    _write(path, TENSORS)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(AdapterFormatError, match=r"t\.safetensors: tensor .* ends at .* truncated"):
        read_header(path)
    path.write_bytes(b"\x05\x00")
    with pytest.raises(AdapterFormatError, match="too short"):
        read_header(path)
    path.write_bytes((10).to_bytes(8, "little") + b"not json!!" + b"\0" * 10)
    with pytest.raises(AdapterFormatError, match="not valid JSON"):
        read_header(path)
    path.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(AdapterFormatError, match="exceeds the file"):
        read_header(path)


def test_scatter_read_into_preallocated_destination(tmp_path):
    from dsv4flash.lifecycle.safetensors_io import read_into

    src = {f"t{i}": torch.randn(3, i + 1) for i in range(2500)}  # > IOV_MAX buffers per call
    src["bf"] = torch.randn(4, 4).to(torch.bfloat16)
    _write(tmp_path / "m.safetensors", src)
    dest = {k: torch.empty_like(v) for k, v in src.items()}
    n = read_into(tmp_path / "m.safetensors", dest, threads=3)
    assert n == sum(v.numel() * v.element_size() for v in src.values())
    assert all(torch.equal(dest[k], v) for k, v in src.items())
    with pytest.raises(AdapterFormatError, match="destination lacks"):
        read_into(tmp_path / "m.safetensors", {k: v for k, v in dest.items() if k != "t3"})
    dest["t5"] = torch.empty(6, 3)
    with pytest.raises(AdapterFormatError, match="'t5' is F32\\[3, 6\\]"):
        read_into(tmp_path / "m.safetensors", dest)
