"""Streaming safetensors reader and writer with strict header validation.

File layout: an 8-byte little-endian header length N, N bytes of JSON header, then the data buffer. Every
tensor entry is ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data buffer; entries
must tile the buffer exactly (no gap, no overlap, nothing after the last one). The reader checks all of that
up front and names the file and tensor when something is off; it reads a tensor, or a range of its rows,
with positioned reads, never the whole file. The writer fixes the header first, then takes tensors in any
order, each row chunk by row chunk, into a hidden pre-sized temp file in the target directory that is
renamed into place only once every byte has been written. Its headers match the `safetensors` library byte
for byte (`library_order` gives that library's tensor order), or reproduce a given header verbatim.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

__all__ = [
    "SafetensorsError", "TensorInfo", "TensorSpec", "SafetensorsReader", "SafetensorsWriter", "DTYPES",
    "dtype_name", "library_order", "save_file", "load_file", "fsync_dir", "parse_header", "encode_header",
]

if sys.byteorder != "little":  # the format is little-endian and tensors are read by reinterpreting bytes
    raise ImportError("dsv4flash_bridge.safetensors_io needs a little-endian machine")

# In the `safetensors` library's Dtype order, which decides its on-disk tensor order (larger rank first).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I16": torch.int16, "U16": torch.uint16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_RANK = {k: i for i, k in enumerate(DTYPES)}
_ITEMSIZE = {k: v.itemsize for k, v in DTYPES.items()}
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
MAX_HEADER_BYTES = 100_000_000  # the `safetensors` library's own limit


class SafetensorsError(ValueError):
    """A malformed, truncated or inconsistent safetensors file, or a misuse of the writer; names the file."""


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype."""
    if dtype not in _NAMES:
        raise SafetensorsError(f"torch dtype {dtype} has no safetensors equivalent")
    return _NAMES[dtype]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: name, safetensors dtype string and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of the data in bytes."""
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (index along dim 0); the whole tensor for 0-d."""
        return math.prod(self.shape[1:]) * DTYPES[self.dtype].itemsize

    @property
    def rows(self) -> int:
        """Length along dim 0 (1 for a 0-d tensor)."""
        return self.shape[0] if self.shape else 1


@dataclass(frozen=True)
class TensorInfo(TensorSpec):
    """A tensor as found in a file: its spec plus absolute byte offsets [start, stop) in that file."""

    start: int = 0
    stop: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the data."""
        return DTYPES[self.dtype]


def library_order(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """Tensors in the order `safetensors.torch.save_file` lays them out: dtype rank descending, then name."""
    return sorted(specs, key=lambda s: (-_RANK[s.dtype], s.name))


def _check_spec(where: str, name: str, dtype, shape) -> tuple[int, ...]:
    """Validate a dtype string and shape list of one header entry or spec; returns the shape tuple."""
    if dtype not in DTYPES:
        raise SafetensorsError(f"{where}: tensor {name!r} has unknown or unsupported dtype {dtype!r} "
                               f"(known: {', '.join(DTYPES)})")
    if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0
                                                      for d in shape):
        raise SafetensorsError(f"{where}: tensor {name!r} has invalid shape {shape!r}")
    return tuple(shape)


def _parse_header(path: Path, blob: bytes, data_start: int, file_size: int | None):
    """Validate a header blob; return ({name: TensorInfo} in offset order, metadata dict). Offsets are
    absolute (data_start added); with file_size None the data extent is not checked."""
    def no_duplicates(pairs):
        out = dict(pairs)
        if len(out) != len(pairs):
            keys = [k for k, _ in pairs]
            raise SafetensorsError(f"{path}: duplicate key {next(k for k in keys if keys.count(k) > 1)!r} in header")
        return out

    try:
        header = json.loads(blob.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: header is not valid JSON in UTF-8 ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    entries, where = [], str(path)  # hot: every cold adapter load parses one entry per tensor
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.keys() != _ENTRY_KEYS:
            raise SafetensorsError(f"{path}: tensor {name!r} entry must have exactly dtype, shape, data_offsets")
        dtype, offsets = entry["dtype"], entry["data_offsets"]
        shape = _check_spec(where, name, dtype, entry["shape"])
        if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
                or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1]):
            raise SafetensorsError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != nbytes:
            raise SafetensorsError(f"{path}: tensor {name!r} shape {list(shape)} {dtype} needs {nbytes} "
                                   f"bytes but data_offsets {offsets} span {offsets[1] - offsets[0]}")
        entries.append(TensorInfo(name, dtype, shape, data_start + offsets[0], data_start + offsets[1]))
    entries.sort(key=lambda i: (i.start, i.stop))
    cursor = data_start
    for info in entries:
        if info.start != cursor:
            what = "overlaps the previous tensor" if info.start < cursor else f"leaves a gap of {info.start - cursor} bytes"
            raise SafetensorsError(f"{path}: tensor {info.name!r} at data offset {info.start - data_start} {what}")
        cursor = info.stop
    if file_size is not None and cursor > file_size:
        last = entries[-1].name
        raise SafetensorsError(f"{path}: truncated: tensor {last!r} ends at byte {cursor} of a {file_size}-byte file")
    if file_size is not None and cursor < file_size:
        raise SafetensorsError(f"{path}: {file_size - cursor} bytes after the last tensor (header and data disagree)")
    return {i.name: i for i in entries}, metadata


def encode_header(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None,
                  where: str | os.PathLike = "<header>") -> bytes:
    """The header blob (JSON after the 8-byte length, space-padded to 8 bytes) laying `specs` out in the given
    order: the `safetensors` library's exact format (pass `library_order(specs)` for its tensor order)."""
    header: dict = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError(f"{where}: metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for spec in specs:
        shape = _check_spec(str(where), spec.name, spec.dtype, list(spec.shape))
        if spec.name in header:
            raise SafetensorsError(f"{where}: tensor name {spec.name!r} is reserved or given twice")
        header[spec.name] = {"dtype": spec.dtype, "shape": list(shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return blob + b" " * (-len(blob) % 8)


def parse_header(blob: bytes, where: str | os.PathLike = "<header>") -> tuple[list[TensorInfo], dict]:
    """Validate a header blob (the JSON after the 8-byte length) on its own: (tensors in data order with
    data-relative offsets, metadata)."""
    infos, metadata = _parse_header(Path(where), blob, 0, None)
    return list(infos.values()), metadata


class SafetensorsReader:
    """Random access to one safetensors file: header parsed and validated on open, data read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise SafetensorsError(f"{self.path}: no such file") from None
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 8:
                raise SafetensorsError(f"{self.path}: truncated: {size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(os.pread(self._file.fileno(), 8, 0), "little")
            if n > MAX_HEADER_BYTES:
                raise SafetensorsError(f"{self.path}: header length {n} exceeds {MAX_HEADER_BYTES} bytes")
            if 8 + n > size:
                raise SafetensorsError(f"{self.path}: truncated: header length {n} runs past the end of a {size}-byte file")
            self.data_start = 8 + n
            self.header_blob = os.pread(self._file.fileno(), n, 8)
            self.tensors, self.metadata = _parse_header(self.path, self.header_blob, 8 + n, size)
        except BaseException:
            self._file.close()
            raise

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def names(self) -> list[str]:
        """Tensor names in data order."""
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        """Header entry of one tensor."""
        if name not in self.tensors:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}")
        return self.tensors[name]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, in fresh memory."""
        info = self.info(name)
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        self._read_into(buf, info.start, info)
        return buf.view(info.torch_dtype).reshape(info.shape)

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of a tensor (along dim 0), into `out` if given (contiguous, right dtype/shape)."""
        info = self.info(name)
        if not info.shape:
            raise SafetensorsError(f"{self.path}: tensor {name!r} is 0-d and has no rows")
        if not 0 <= start <= stop <= info.shape[0]:
            raise SafetensorsError(f"{self.path}: rows [{start}, {stop}) out of range for {name!r} with {info.shape[0]} rows")
        shape = (stop - start, *info.shape[1:])
        if out is None:
            out = torch.empty(shape, dtype=info.torch_dtype)
        elif out.dtype != info.torch_dtype or tuple(out.shape) != shape or not out.is_contiguous():
            raise SafetensorsError(f"{self.path}: out for {name!r} must be contiguous {info.torch_dtype} {shape}, "
                                   f"got {out.dtype} {tuple(out.shape)}")
        self._read_into(out.view(-1).view(torch.uint8), info.start + start * info.row_bytes, info)
        return out

    def iter_rows(self, name: str, rows_per_chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) chunks of a tensor; each chunk is fresh memory of at most `rows_per_chunk` rows."""
        total = self.info(name).shape[0]
        for start in range(0, total, max(1, rows_per_chunk)):
            yield start, self.read_rows(name, start, min(start + rows_per_chunk, total))

    def _read_into(self, buf: torch.Tensor, offset: int, info: TensorInfo) -> None:
        """Fill a uint8 buffer from the file at `offset`; a short read means the file shrank since open."""
        view, done = memoryview(buf.numpy()).cast("B"), 0
        while done < len(view):
            got = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            if got == 0:
                raise SafetensorsError(f"{self.path}: truncated while reading tensor {info.name!r} "
                                       f"(file changed after it was opened?)")
            done += got


class SafetensorsWriter:
    """Writes one safetensors file whose header is fixed up front, row chunk by row chunk.

    Tensors may be written in any order (positioned writes into a pre-sized file); the rows of one tensor
    arrive in order. Use as a context manager: on a clean exit every tensor must be complete, then the
    temp file is fsynced and renamed to `path`; on an exception or an incomplete tensor the temp file is
    removed and `path` is left untouched.
    """

    def __init__(self, path: str | os.PathLike, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        blob = encode_header(specs, metadata, self.path)
        self._open(blob, parse_header(blob, self.path)[0])

    @classmethod
    def from_header(cls, path: str | os.PathLike, blob: bytes) -> "SafetensorsWriter":
        """A writer that reproduces a given header blob verbatim (e.g. a release shard's, for bit-exact export)."""
        self = cls.__new__(cls)
        self.path = Path(path)
        infos, _ = _parse_header(self.path, blob, 8 + len(blob), None)
        self._open(blob, [TensorInfo(i.name, i.dtype, i.shape, i.start - 8 - len(blob), i.stop - 8 - len(blob))
                          for i in infos.values()])
        return self

    def _open(self, blob: bytes, infos: list[TensorInfo]) -> None:
        """Create the pre-sized temp file with the header; `infos` carry data-relative offsets."""
        self.specs = [TensorSpec(i.name, i.dtype, i.shape) for i in infos]
        self._start = {i.name: 8 + len(blob) + i.start for i in infos}
        self._spec = dict(zip(self._start, self.specs))
        self._rows = {i.name: 0 for i in infos}
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._tmp, "wb")
        self._file.write(len(blob).to_bytes(8, "little") + blob)
        self._file.truncate(8 + len(blob) + sum(s.nbytes for s in self.specs))
        self._file.flush()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write a whole tensor."""
        spec = self._lookup(name)
        if tuple(tensor.shape) != tuple(spec.shape):
            raise SafetensorsError(f"{self.path}: tensor {name!r} has shape {tuple(tensor.shape)}, spec says {spec.shape}")
        self.write_rows(name, tensor.reshape(1) if not spec.shape else tensor)

    def write_rows(self, name: str, rows: torch.Tensor) -> None:
        """Write the next rows (along dim 0) of a tensor, continuing where its last chunk stopped."""
        spec = self._lookup(name)
        if DTYPES[spec.dtype] != rows.dtype:
            raise SafetensorsError(f"{self.path}: tensor {name!r} is {spec.dtype}, got a {rows.dtype} chunk")
        done, total = self._rows[name], (spec.shape[0] if spec.shape else 1)
        if tuple(rows.shape[1:]) != tuple(spec.shape[1:]) or done + rows.shape[0] > total:
            raise SafetensorsError(f"{self.path}: chunk {tuple(rows.shape)} does not fit tensor {name!r} {spec.shape} "
                                   f"after {done} rows")
        data = memoryview(rows.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
        offset, written = self._start[name] + done * spec.row_bytes, 0
        while written < len(data):
            written += os.pwrite(self._file.fileno(), data[written:], offset + written)
        self._rows[name] = done + rows.shape[0]

    def missing(self) -> list[str]:
        """Tensors not yet complete."""
        return [s.name for s in self.specs if self._rows[s.name] < (s.shape[0] if s.shape else 1)]

    def close(self) -> None:
        """Finish: every tensor must be complete; fsync, rename into place, fsync the directory."""
        if self._file.closed:
            return
        missing = self.missing()
        if missing:
            spec = self._spec[missing[0]]
            self.abort()
            raise SafetensorsError(f"{self.path}: incomplete, tensor {spec.name!r} has {self._rows[spec.name]} of "
                                   f"{spec.shape[0] if spec.shape else 1} rows written; nothing was saved")
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Drop the partial file; `path` is untouched."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def _lookup(self, name: str) -> TensorSpec:
        """The spec of a tensor of this file."""
        if name not in self._spec:
            raise SafetensorsError(f"{self.path}: no tensor {name!r} in this file's header")
        return self._spec[name]


@contextlib.contextmanager
def all_or_nothing(writers: Mapping[str, SafetensorsWriter]) -> Iterator[Mapping[str, SafetensorsWriter]]:
    """Close every writer (rename into place) when the block succeeds; abort every one if it raises or any file
    is incomplete. Completeness is checked for all before any is renamed, so an incomplete set publishes nothing."""
    try:
        yield writers
        for writer in writers.values():
            if writer.missing():
                writer.close()  # raises SafetensorsError naming the first unwritten tensor
        for writer in writers.values():
            writer.close()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise


def fsync_dir(directory: Path) -> None:
    """Make a rename durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None, *, order: str = "library") -> None:
    """Write a dict of tensors; `order="library"` reproduces `safetensors.torch.save_file` byte for byte,
    `order="given"` keeps the mapping's order."""
    specs = [TensorSpec(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    if order == "library":
        specs = library_order(specs)
    elif order != "given":
        raise ValueError(f"order must be 'library' or 'given', got {order!r}")
    with SafetensorsWriter(path, specs, metadata) as writer:
        for spec in specs:
            writer.write(spec.name, tensors[spec.name])


def load_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read every tensor of a file (small files and tests; use SafetensorsReader to stream)."""
    with SafetensorsReader(path) as reader:
        return {name: reader.read(name) for name in reader.names()}
