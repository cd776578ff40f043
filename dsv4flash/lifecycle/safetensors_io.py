"""Safetensors bytes, written deterministically and read with one buffer instead of one object per tensor.

The format itself — dtype table, tensor order, header encoding and header validation — is the checkpoint
bridge's (`dsv4flash_bridge.safetensors_io`), so the lifecycle and the converter cannot drift apart; this
module keeps the lifecycle's I/O strategies on top of it.

Writer: tensors are laid out in the `safetensors` library's order (dtype rank, then name), which keeps every
tensor aligned to its element size, with the header padded to 8 bytes; the same tensors always give the
same bytes (the library's own bytes), which is what lets a revision be addressed by the sha256 of its file.

Reader: one `os.preadv` per chunk into a single preallocated (optionally pinned) uint8 buffer, split over
a few threads, then zero-copy views per tensor. A packed MoE adapter (a few hundred tensors) therefore
loads at page-cache/memcpy speed; a per-expert adapter (~92k tensors) pays per-tensor overhead in
whatever reads it.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Callable, Mapping

import torch

from dsv4flash.lifecycle.errors import AdapterFormatError
from dsv4flash_bridge import safetensors_io as _st

if TYPE_CHECKING:
    from dsv4flash.lifecycle.blob_backend import ByteSource

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
    "FileSource",
]

DTYPES: dict[str, torch.dtype] = _st.DTYPES
_ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in DTYPES.items()}
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


def _spec(name: str, t: torch.Tensor) -> _st.TensorSpec:
    try:
        return _st.TensorSpec(name, _st.dtype_name(t.dtype), tuple(t.shape))
    except _st.SafetensorsError:
        raise AdapterFormatError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name") from None


def encode_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The 8-byte length + padded JSON header for `tensors`, and the order their bytes must follow."""
    specs = _st.library_order([_spec(n, t) for n, t in tensors.items()])
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    try:
        blob = _st.encode_header(specs, meta)
    except _st.SafetensorsError as exc:
        raise AdapterFormatError(str(exc)) from None
    return struct.pack("<Q", len(blob)) + blob, [s.name for s in specs]


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
    src = FileSource(path, fd)
    try:
        return _parse_header(src)
    finally:
        src.close()


class FileSource:
    """A `ByteSource` over one open file (`os.pread`/`os.preadv` on its descriptor)."""

    def __init__(self, path: str | os.PathLike, fd: int | None = None):
        self.name = str(path)
        self._own = fd is None
        self.fd = os.open(path, os.O_RDONLY) if fd is None else fd
        self.size = os.fstat(self.fd).st_size

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset`."""
        return os.pread(self.fd, n, offset)

    def readinto_at(self, view: memoryview, offset: int) -> None:
        """Fill `view` from `offset`; a short read (the file shrank) is an error naming the byte."""
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise AdapterFormatError(f"{self.name}: short read at byte {offset + done} (file truncated while reading?)")
            done += got

    def close(self) -> None:
        """Close the descriptor (unless the caller passed it in)."""
        if self._own:
            os.close(self.fd)


def _parse_header(src) -> SafetensorsHeader:
    """The header of the safetensors bytes behind a `ByteSource` (dsv4flash.lifecycle.blob_backend)."""
    path, size = src.name, src.size
    first = src.pread(8, 0)
    if len(first) != 8:
        raise AdapterFormatError(f"{path}: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", first)
    if n > min(_MAX_HEADER, size - 8):
        raise AdapterFormatError(f"{path}: header length {n} exceeds the file ({size} bytes)")
    blob = src.pread(n, 8)
    try:
        infos, metadata = _st.parse_header(blob, path)
    except _st.SafetensorsError as exc:
        raise AdapterFormatError(str(exc)) from None
    entries = tuple(TensorEntry(i.name, i.dtype, i.shape, i.start, i.stop) for i in infos)
    data_size = size - 8 - n
    if entries and entries[-1].end > data_size:
        raise AdapterFormatError(f"{path}: tensor {entries[-1].name!r} ends at {entries[-1].end} past the data "
                                 f"({data_size} bytes; truncated file?)")
    return SafetensorsHeader(entries, dict(metadata), 8 + n, data_size)


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise AdapterFormatError(f"short read at byte {offset + done} (file truncated while reading?)")
        done += got


def read_safetensors(
    path: str | os.PathLike | ByteSource,
    *,
    pin_memory: bool = False,
    threads: int = 2,
    chunk: int = 64 << 20,
    on_chunk: Callable[[memoryview], None] | None = None,
) -> tuple[dict[str, torch.Tensor], SafetensorsHeader]:
    """Read a whole safetensors file (a path, or any `ByteSource`: a stored blob) into one buffer and return
    zero-copy tensor views plus the header.

    `on_chunk` sees every byte of the file in order, header first (used to hash while reading); with it,
    reads stay sequential so the hash can follow them.
    """
    if isinstance(path, (str, os.PathLike)):
        src = FileSource(path)
        try:
            return read_safetensors(src, pin_memory=pin_memory, threads=threads, chunk=chunk, on_chunk=on_chunk)
        finally:
            src.close()
    src = path
    header = _parse_header(src)
    buf = torch.empty(header.data_size, dtype=torch.uint8, pin_memory=pin_memory)
    view = memoryview(buf.numpy()) if header.data_size else memoryview(b"")
    spans = [(o, min(o + chunk, header.data_size)) for o in range(0, header.data_size, chunk)]
    if on_chunk is not None:
        on_chunk(memoryview(src.pread(header.data_offset, 0)))
    if on_chunk is not None or threads <= 1 or len(spans) <= 1:
        for lo, hi in spans:
            src.readinto_at(view[lo:hi], header.data_offset + lo)
            if on_chunk is not None:
                on_chunk(view[lo:hi])
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda s: src.readinto_at(view[s[0]:s[1]], header.data_offset + s[0]), spans))
    return _views(buf, header.entries), header


def _views(buf: torch.Tensor, entries: tuple[TensorEntry, ...]) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over `buf`, one `split` per run of same-dtype tensors (the library's order keeps a
    dtype's tensors together): two torch calls per tensor fewer than slicing each one out, which is a tenth of
    a packed adapter's load on the host."""
    out: dict[str, torch.Tensor] = {}
    i = 0
    while i < len(entries):
        dtype, j = entries[i].dtype, i + 1
        while j < len(entries) and entries[j].dtype == dtype:
            j += 1
        run, size = entries[i:j], _ITEMSIZE[dtype]
        if run[0].start % size:  # a foreign file with unaligned offsets: one copy each instead of a crash
            out.update((e.name, buf[e.start:e.end].clone().view(DTYPES[dtype]).view(e.shape)) for e in run)
        else:  # entries are contiguous in offset order (the header check refuses gaps and overlaps)
            flat = buf[run[0].start:run[-1].end].view(DTYPES[dtype])
            parts = flat.split([(e.end - e.start) // size for e in run])
            out.update((e.name, part.view(e.shape)) for e, part in zip(run, parts))
        i = j
    return out


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
