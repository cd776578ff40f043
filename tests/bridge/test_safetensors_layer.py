"""Safetensors IO tests: byte compatibility with the `safetensors` library, streaming reads/writes, and
clear errors (naming file and tensor) for malformed files, with nothing left behind on failure."""

from __future__ import annotations

import json
import os
import struct

import pytest
import safetensors.torch
import torch

from dsv4flash_bridge import safetensors_io as io
from dsv4flash_bridge.safetensors_io import SafetensorsError, SafetensorsReader, SafetensorsWriter, TensorSpec


def sample_tensors() -> dict[str, torch.Tensor]:
    """One tensor of every supported dtype, plus 0-d and empty ones, with non-trivial bytes."""
    g = torch.Generator().manual_seed(0)
    raw = lambda n: torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)  # noqa: E731
    out = {}
    for i, (name, dtype) in enumerate(io.DTYPES.items()):
        shape = (3, 5) if i % 2 else (7,)
        n = torch.Size(shape).numel() * dtype.itemsize
        t = raw(n)
        if dtype == torch.bool:
            t = t % 2
        if dtype in (torch.float8_e4m3fn,):
            t[(t & 0x7F) == 0x7F] = 0  # NaN bytes compare unequal
        out[f"t.{name.lower()}"] = t.view(dtype).reshape(shape)
    out["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    out["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    return out


def bitwise_equal(a: dict, b: dict) -> bool:
    """Same names, dtypes, shapes and bytes."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


# ------------------------------------------------------------------------------- compatibility
# One metadata key only: the library keeps metadata in a Rust HashMap, so it orders several keys at random.
@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"note": "ünïcode"}])
def test_writes_the_same_bytes_as_the_library(tmp_path, metadata):
    tensors = sample_tensors()
    safetensors.torch.save_file(tensors, tmp_path / "lib.safetensors", metadata=metadata)
    io.save_file(tensors, tmp_path / "ours.safetensors", metadata=metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()


def test_reads_library_files_identically(tmp_path):
    tensors = sample_tensors()
    safetensors.torch.save_file(tensors, tmp_path / "lib.safetensors", metadata={"k": "v"})
    with SafetensorsReader(tmp_path / "lib.safetensors") as reader:
        assert reader.metadata == {"k": "v"}
        assert bitwise_equal({n: reader.read(n) for n in reader.names()}, tensors)


def test_library_reads_our_streamed_files_identically(tmp_path):
    tensors = sample_tensors()
    specs = [TensorSpec(k, io.dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    with SafetensorsWriter(tmp_path / "ours.safetensors", specs) as writer:
        for spec in specs:
            t = tensors[spec.name]
            if t.dim() >= 1 and t.shape[0] > 1:  # row chunk by row chunk
                for r in range(t.shape[0]):
                    writer.write_rows(spec.name, t[r:r + 1])
            else:
                writer.write(spec.name, t)
    assert bitwise_equal(safetensors.torch.load_file(tmp_path / "ours.safetensors"), tensors)
    assert list(io.load_file(tmp_path / "ours.safetensors")) == list(tensors)  # given order kept


# --------------------------------------------------------------------------------------- reading
def test_row_ranges_read_only_those_bytes(tmp_path, monkeypatch):
    big = torch.arange(1000 * 64, dtype=torch.float32).reshape(1000, 64)
    io.save_file({"a": torch.ones(3), "big": big}, tmp_path / "f.safetensors")
    reads = []
    real = os.preadv
    monkeypatch.setattr(io.os, "preadv", lambda fd, bufs, off: reads.append(sum(len(b) for b in bufs)) or real(fd, bufs, off))
    with SafetensorsReader(tmp_path / "f.safetensors") as reader:
        assert torch.equal(reader.read_rows("big", 500, 510), big[500:510])
        assert reads == [10 * 64 * 4]
        out = torch.empty(3, 64)
        assert reader.read_rows("big", 997, 1000, out=out) is out and torch.equal(out, big[997:])
        chunks = list(reader.iter_rows("big", 300))
        assert [s for s, _ in chunks] == [0, 300, 600, 900] and torch.equal(torch.cat([c for _, c in chunks]), big)
        with pytest.raises(SafetensorsError, match=r"rows \[990, 1001\) out of range for 'big'"):
            reader.read_rows("big", 990, 1001)
        with pytest.raises(SafetensorsError, match="out for 'big' must be contiguous"):
            reader.read_rows("big", 0, 2, out=torch.empty(2, 64, dtype=torch.float64))
        with pytest.raises(SafetensorsError, match="no tensor named 'nope'"):
            reader.read("nope")


# ----------------------------------------------------------------------------- malformed files
def write_raw(path, header, data: bytes, length: int | None = None) -> None:
    """A file with an arbitrary header object (or bytes) and data."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]}}


@pytest.mark.parametrize("header,data,length,message", [
    (GOOD, bytes(12), None, r"truncated: tensor 'b' ends at byte"),
    (GOOD, bytes(20), None, r"4 bytes after the last tensor"),
    (GOOD, bytes(16), 10_000, r"truncated: header length 10000 runs past the end"),
    (GOOD, bytes(16), 200_000_000, r"header length 200000000 exceeds"),
    ({**GOOD, "b": {**GOOD["b"], "shape": [2, 3]}}, bytes(16), None, r"'b' shape \[2, 3\] BF16 needs 12 bytes but data_offsets \[8, 16\] span 8"),
    ({**GOOD, "b": {**GOOD["b"], "data_offsets": [4, 12]}}, bytes(12), None, r"'b' at data offset 4 overlaps the previous tensor"),
    ({**GOOD, "b": {**GOOD["b"], "data_offsets": [12, 20]}}, bytes(20), None, r"'b' at data offset 12 leaves a gap of 4 bytes"),
    ({**GOOD, "b": {**GOOD["b"], "dtype": "F8_E4M3FN"}}, bytes(16), None, r"'b' has unknown or unsupported dtype 'F8_E4M3FN'"),
    ({**GOOD, "b": {**GOOD["b"], "shape": [2, -2]}}, bytes(16), None, r"'b' has invalid shape"),
    ({**GOOD, "b": {**GOOD["b"], "data_offsets": [16, 8]}}, bytes(16), None, r"'b' has invalid data_offsets"),
    ({**GOOD, "b": {"dtype": "BF16", "shape": [4]}}, bytes(16), None, r"'b' entry must have exactly"),
    ({**GOOD, "__metadata__": {"x": 1}}, bytes(16), None, r"__metadata__ must map strings to strings"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', bytes(4), None, r"duplicate key 'a'"),
    (b'{"a": ', bytes(4), None, r"header is not valid JSON in UTF-8"),
    (b"[1, 2]", b"", None, r"header is not a JSON object"),
])
def test_malformed_headers_are_rejected_naming_file_and_tensor(tmp_path, header, data, length, message):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data, length)
    with pytest.raises(SafetensorsError, match=message) as err:
        SafetensorsReader(path)
    assert str(path) in str(err.value)


def test_tiny_and_missing_files(tmp_path):
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="truncated: 2 bytes"):
        SafetensorsReader(tmp_path / "tiny.safetensors")
    with pytest.raises(SafetensorsError, match="no such file"):
        SafetensorsReader(tmp_path / "absent.safetensors")


def test_file_shrinking_after_open_is_reported(tmp_path):
    io.save_file({"x": torch.ones(100, 10)}, tmp_path / "f.safetensors")
    reader = SafetensorsReader(tmp_path / "f.safetensors")
    os.truncate(tmp_path / "f.safetensors", 200)
    with pytest.raises(SafetensorsError, match="truncated while reading tensor 'x'"):
        reader.read("x")
    reader.close()


# ------------------------------------------------------------------------------------- writing
def no_files_left(directory) -> bool:
    """Nothing at all was left in the directory, temp files included."""
    return not any(directory.iterdir())


def test_writer_failures_leave_nothing_behind(tmp_path):
    specs = [TensorSpec("a", "F32", (4, 2)), TensorSpec("b", "BF16", (3,))]
    target = tmp_path / "out" / "f.safetensors"
    with pytest.raises(SafetensorsError, match="incomplete, tensor 'a' has 2 of 4 rows"):
        with SafetensorsWriter(target, specs) as w:
            w.write_rows("a", torch.zeros(2, 2))
    assert no_files_left(target.parent)
    with pytest.raises(RuntimeError, match="boom"):
        with SafetensorsWriter(target, specs) as w:
            w.write("a", torch.zeros(4, 2))
            raise RuntimeError("boom")
    assert no_files_left(target.parent)
    for bad, message in [
        (lambda w: w.write("c", torch.zeros(3, dtype=torch.bfloat16)), "no tensor 'c' in this file's header"),
        (lambda w: w.write("b", torch.zeros(3, dtype=torch.bfloat16)), "incomplete, tensor 'a' has 0 of 4 rows"),
        (lambda w: (w.write("b", torch.zeros(3, dtype=torch.bfloat16)), w.write_rows("b", torch.zeros(1, dtype=torch.bfloat16))),
         r"chunk \(1,\) does not fit tensor 'b' \(3,\) after 3 rows"),
        (lambda w: w.write_rows("a", torch.zeros(5, 2)), r"chunk \(5, 2\) does not fit tensor 'a'"),
        (lambda w: w.write_rows("a", torch.zeros(1, 3)), r"chunk \(1, 3\) does not fit"),
        (lambda w: w.write("a", torch.zeros(4, 2, dtype=torch.float64)), "'a' is F32, got a torch.float64 chunk"),
        (lambda w: w.write("a", torch.zeros(2, 4)), r"'a' has shape \(2, 4\), spec says \(4, 2\)"),
    ]:
        with pytest.raises(SafetensorsError, match=message):
            with SafetensorsWriter(target, specs) as w:
                bad(w)
        assert no_files_left(target.parent)


def test_existing_file_is_replaced_only_on_success(tmp_path):
    target = tmp_path / "f.safetensors"
    io.save_file({"x": torch.ones(2)}, target)
    before = target.read_bytes()
    with pytest.raises(SafetensorsError):
        with SafetensorsWriter(target, [TensorSpec("x", "F32", (3,))]) as w:
            w.write_rows("x", torch.zeros(1))
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["f.safetensors"]
    io.save_file({"x": torch.zeros(3)}, target)
    assert torch.equal(io.load_file(target)["x"], torch.zeros(3))


def test_any_tensor_order_and_verbatim_headers(tmp_path):
    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(4, 3), "b": torch.ones(5, dtype=torch.bfloat16),
               "c": torch.tensor(7, dtype=torch.int64)}
    odd = b'{"b":{"dtype":"BF16","shape":[5],"data_offsets":[0,10]},  "a":{"dtype":"F32","shape":[4,3],' \
          b'"data_offsets":[10,58]},"c":{"dtype":"I64","shape":[],"data_offsets":[58,66]}}'
    target = tmp_path / "f.safetensors"
    with SafetensorsWriter.from_header(target, odd) as w:
        assert [s.name for s in w.specs] == ["b", "a", "c"]
        w.write("c", tensors["c"])
        w.write_rows("a", tensors["a"][:1])
        w.write("b", tensors["b"])
        w.write_rows("a", tensors["a"][1:])
    data = target.read_bytes()
    assert data[8:8 + len(odd)] == odd  # the header is reproduced byte for byte, odd spacing included
    assert bitwise_equal(safetensors.torch.load_file(target), tensors)
    with pytest.raises(SafetensorsError, match="'a' at data offset 12 leaves a gap"):
        SafetensorsWriter.from_header(target, odd.replace(b"[10,58]", b"[12,60]"))


def test_bad_specs_are_rejected(tmp_path):
    with pytest.raises(SafetensorsError, match="unknown or unsupported dtype 'F4'"):
        SafetensorsWriter(tmp_path / "f.safetensors", [TensorSpec("x", "F4", (2,))])
    with pytest.raises(SafetensorsError, match="'x' is reserved or given twice"):
        SafetensorsWriter(tmp_path / "f.safetensors", [TensorSpec("x", "F32", (2,)), TensorSpec("x", "F32", (2,))])
    with pytest.raises(SafetensorsError, match="has no safetensors equivalent"):
        io.dtype_name(torch.complex64)
    assert not any(p.name.endswith(".safetensors") for p in tmp_path.iterdir())


def test_the_lifecycle_writes_the_bridge_format(tmp_path):
    """One format: the lifecycle's stream writer and the bridge's writer give the same bytes."""
    from io import BytesIO

    from dsv4flash.lifecycle.safetensors_io import read_header, write_safetensors

    tensors = {"z.f32": torch.randn(3, 5), "a.i32": torch.arange(4, dtype=torch.int32),
               "m.bf16": torch.randn(2, 2).to(torch.bfloat16), "s.e8m0": torch.ones(4).to(torch.float8_e8m0fnu),
               "q.i8": torch.tensor([1, -1], dtype=torch.int8)}
    stream = BytesIO()
    write_safetensors(stream, tensors, {"format": "pt"})
    io.save_file(tensors, tmp_path / "b.safetensors", {"format": "pt"})
    assert stream.getvalue() == (tmp_path / "b.safetensors").read_bytes()
    (tmp_path / "l.safetensors").write_bytes(stream.getvalue())
    with SafetensorsReader(tmp_path / "l.safetensors") as reader:
        assert [(e.name, e.start) for e in read_header(tmp_path / "l.safetensors").entries] == \
               [(n, reader.info(n).start - reader.data_start) for n in reader.names()]


def test_all_or_nothing_publishes_every_shard_or_none(tmp_path):
    """A failure while writing one shard, or one shard left incomplete, removes every shard of the set."""
    specs = [TensorSpec("a", "F32", (2, 2))]
    out = tmp_path / "ckpt"

    def writers():
        return {n: SafetensorsWriter(out / n, specs) for n in ("s1.safetensors", "s2.safetensors")}

    with pytest.raises(RuntimeError, match="boom"):
        with io.all_or_nothing(writers()) as ws:
            ws["s1.safetensors"].write("a", torch.ones(2, 2))
            raise RuntimeError("boom")
    assert no_files_left(out)
    with pytest.raises(SafetensorsError, match="incomplete"):
        with io.all_or_nothing(writers()) as ws:
            ws["s1.safetensors"].write("a", torch.ones(2, 2))  # s2 never written: its close fails
    assert no_files_left(out)
    with io.all_or_nothing(writers()) as ws:
        for w in ws.values():
            w.write("a", torch.full((2, 2), 3.0))
    assert sorted(p.name for p in out.iterdir()) == ["s1.safetensors", "s2.safetensors"]
    assert torch.equal(safetensors.torch.load_file(str(out / "s2.safetensors"))["a"], torch.full((2, 2), 3.0))
