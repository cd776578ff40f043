"""Safetensors bytes, written deterministically and read with one buffer instead of one object per tensor.

Writer: tensors are laid out by (element size descending, name) so every tensor starts aligned to its
element size, and the header is padded to 8 bytes; the same tensors always give the same bytes, which is
what lets a revision be addressed by the sha256 of its file. Files are standard safetensors (the
`safetensors` package reads them).

Reader: one `os.preadv` per chunk into a single preallocated (optionally pinned) uint8 buffer, split over
a few threads, then zero-copy views per tensor. A packed MoE adapter (a few hundred tensors) therefore
loads at page-cache/memcpy speed; a per-expert adapter (~92k tensors) pays per-tensor overhead in
whatever reads it.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Callable, Mapping

import torch

from dsv4flash.lifecycle.errors import AdapterFormatError

__all__ = [
    "DTYPES",
    "TensorEntry",
    "SafetensorsHeader",
    "encode_header",
    "iter_payload",
    "write_safetensors",
    "read_header",
    "read_safetensors",
    "read_into",
]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
_MAX_HEADER = 256 * 1024 * 1024  # a 92k-tensor per-expert header is ~13 MB; refuse absurd sizes


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype string, shape and byte range within the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """Parsed header: entries in file order, `__metadata__`, and where the data section starts."""

    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    data_offset: int
    data_size: int


def _dtype_name(t: torch.Tensor, name: str) -> str:
    try:
        return _NAMES[t.dtype]
    except KeyError:
        raise AdapterFormatError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name") from None


def _order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))


def encode_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The 8-byte length + padded JSON header for `tensors`, and the order their bytes must follow."""
    order = _order(tensors)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _dtype_name(t, name), "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def iter_payload(tensors: Mapping[str, torch.Tensor], order: list[str]):
    """Yield each tensor's bytes (as memoryviews, no copy for contiguous CPU tensors) in file order."""
    for name in order:
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.numel():
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(
    out: BinaryIO,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write a safetensors file to an open binary stream; returns bytes written."""
    head, order = encode_header(tensors, metadata)
    total = len(head) + sum(tensors[n].numel() * tensors[n].element_size() for n in order)
    out.write(head)
    done = len(head)
    for chunk in iter_payload(tensors, order):
        out.write(chunk)
        done += len(chunk)
        if on_progress is not None:
            on_progress(done, total)
    return done


def read_header(path: str | os.PathLike, fd: int | None = None) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file (names the file and tensor on error)."""
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, 8, 0)
        if len(first) != 8:
            raise AdapterFormatError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", first)
        if n > min(_MAX_HEADER, size - 8):
            raise AdapterFormatError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            raw = json.loads(os.pread(fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise AdapterFormatError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    finally:
        if own:
            os.close(fd)
    metadata = raw.pop("__metadata__", None) or {}
    entries = []
    for name, info in raw.items():
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise AdapterFormatError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        if dtype not in DTYPES:
            raise AdapterFormatError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        numel = 1
        for s in shape:
            numel *= s
        if end - start != numel * _ITEMSIZE[dtype] or start < 0:
            raise AdapterFormatError(f"{path}: tensor {name!r} byte range {start}..{end} does not fit {dtype}{list(shape)}")
        entries.append(TensorEntry(name, dtype, shape, int(start), int(end)))
    entries.sort(key=lambda e: e.start)
    data_size = size - 8 - n
    if entries and entries[-1].end > data_size:
        raise AdapterFormatError(f"{path}: tensor {entries[-1].name!r} ends at {entries[-1].end} past the data ({data_size} bytes; truncated file?)")
    return SafetensorsHeader(tuple(entries), dict(metadata), 8 + n, data_size)


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise AdapterFormatError(f"short read at byte {offset + done} (file truncated while reading?)")
        done += got


def read_safetensors(
    path: str | os.PathLike,
    *,
    pin_memory: bool = False,
    threads: int = 2,
    chunk: int = 64 << 20,
    on_chunk: Callable[[memoryview], None] | None = None,
) -> tuple[dict[str, torch.Tensor], SafetensorsHeader]:
    """Read a whole safetensors file into one buffer and return zero-copy tensor views plus the header.

    `on_chunk` sees every byte of the file in order, header first (used to hash while reading); with it,
    reads stay sequential so the hash can follow them.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        header = read_header(path, fd)
        buf = torch.empty(header.data_size, dtype=torch.uint8, pin_memory=pin_memory)
        view = memoryview(buf.numpy()) if header.data_size else memoryview(b"")
        spans = [(o, min(o + chunk, header.data_size)) for o in range(0, header.data_size, chunk)]
        if on_chunk is not None:
            on_chunk(memoryview(os.pread(fd, header.data_offset, 0)))
        if on_chunk is not None or threads <= 1 or len(spans) <= 1:
            for lo, hi in spans:
                _pread_into(fd, view[lo:hi], header.data_offset + lo)
                if on_chunk is not None:
                    on_chunk(view[lo:hi])
        else:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                list(pool.map(lambda s: _pread_into(fd, view[s[0]:s[1]], header.data_offset + s[0]), spans))
    finally:
        os.close(fd)
    return {e.name: _view(buf, e) for e in header.entries}, header


def _view(buf: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    raw = buf[e.start:e.end]
    dtype = DTYPES[e.dtype]
    if e.start % _ITEMSIZE[e.dtype]:
        raw = raw.clone()  # a foreign file with unaligned offsets: one copy instead of a crash
    return raw.view(dtype).view(e.shape)


_IOV_MAX = 1024  # Linux limit on buffers per preadv call


def read_into(path: str | os.PathLike, dest: Mapping[str, torch.Tensor], *, threads: int = 2) -> int:
    """Scatter-read every tensor of a safetensors file straight into preallocated `dest` tensors.

    `dest` must hold exactly the file's tensor names, each contiguous on CPU with the file's dtype and
    shape (e.g. one slot of a `SlotPool`). The bytes go from the page cache into their final place in
    one `preadv` per run of up to 1024 tensors — no intermediate buffer, no per-tensor allocation.
    Returns the bytes read.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        header = read_header(path, fd)
        names = {e.name for e in header.entries}
        if names != set(dest):
            missing, extra = sorted(names - set(dest)), sorted(set(dest) - names)
            raise AdapterFormatError(f"{path}: destination lacks {missing[:3]} / has extra {extra[:3]} tensors")
        views = []
        for e in header.entries:
            t = dest[e.name]
            if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != DTYPES[e.dtype] or tuple(t.shape) != e.shape:
                raise AdapterFormatError(f"{path}: tensor {e.name!r} is {e.dtype}{list(e.shape)}, the destination is "
                                         f"{t.dtype}{list(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")
            if e.end > e.start:
                views.append((e, memoryview(t.reshape(-1).view(torch.uint8).numpy())))
        total = sum(e.end - e.start for e, _ in views)
        groups: list[list] = [[] for _ in range(max(1, threads))]
        done = 0
        for item in views:  # split by bytes into `threads` file-contiguous runs
            groups[min(len(groups) - 1, done * len(groups) // max(total, 1))].append(item)
            done += item[0].end - item[0].start

        def run(group) -> None:
            for i in range(0, len(group), _IOV_MAX):
                part = group[i:i + _IOV_MAX]
                offset = header.data_offset + part[0][0].start
                bufs = [v for _, v in part]
                want = sum(len(b) for b in bufs)
                got = os.preadv(fd, bufs, offset)
                if got != want:  # short read: finish buffer by buffer
                    for (e, v) in part:
                        _pread_into(fd, v, header.data_offset + e.start)

        if len(groups) == 1:
            run(groups[0])
        else:
            with ThreadPoolExecutor(max_workers=len(groups)) as pool:
                list(pool.map(run, groups))
        return total
    finally:
        os.close(fd)
