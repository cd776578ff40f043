"""Host-memory table with a deduplicating, device-overlapped row gather (the storage behind `PinnedEngram`).

`HostTable` keeps one Engram table in host memory: pinned when CUDA is available, plain otherwise, or a shared
mapping of a file (one copy per node for every rank on it). Rows are float, or E4M3 with per-32-lane E8M0
scales (the release format, 264 B per 256-wide row). `gather` deduplicates the ids on their device, copies only
the distinct ids to the host, gathers those rows in ascending order chunk by chunk into a reused pinned staging
buffer while the previous chunk's asynchronous copy to the device is in flight, and expands them on the device
with the inverse index. When the rows land on the host in the stored format (a CPU-only run) there is no copy
to save and a repeated row is a cache hit, so it is one plain gather of every id instead, straight into the
caller's `out=` buffers (8-byte scale rows read as one int64 element each), in as few Python steps as the
checks allow (FP8 rows that are dequantized still dedup: each distinct row is decoded once). It is not an nn.Module on purpose: the owning
module keeps it out of `parameters()`, `buffers()` and every `_apply`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["FP8_BLOCK", "GatherStats", "HostTable", "coalesce_rows", "dequantize_rows_e8m0", "element_view",
           "index_rows", "quantize_rows_e8m0"]

FP8_BLOCK = 32  # Engram rows carry one E8M0 scale per 32 lanes (quant_plan ENGRAM_FP8)
# Host gather -> device copy pipelining: about this many chunks, none smaller than this many rows.
_CHUNKS = 8
_MIN_CHUNK_ROWS = 4096
_E4M3_MAX = 448.0


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ID_DTYPES = (torch.int32, torch.int64)


def element_view(table: torch.Tensor) -> Optional[torch.Tensor]:
    """The 1-D integer view [rows] of a contiguous 2-D table whose rows are 1/2/4/8 bytes, else None."""
    as_int = _INT_VIEWS.get(table.shape[1] * table.element_size())
    if as_int is None or not table.is_contiguous():
        return None
    return table.view(as_int).view(-1)


def index_rows(table: torch.Tensor, ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`table.index_select(0, ids)` for a 2-D table; rows of 1/2/4/8 bytes (the E8M0 scales) go through a
    1-D integer view, which takes torch's element kernel instead of its ~10x slower narrow-row path."""
    elements = element_view(table)
    if elements is None:
        return torch.index_select(table, 0, ids, out=out)
    flat_out = None if out is None else out.view(elements.dtype).view(-1)
    rows = torch.index_select(elements, 0, ids, out=flat_out)
    return rows.view(table.dtype).view(-1, table.shape[1])


def quantize_rows_e8m0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows [R, D] -> (E4M3 rows [R, D], E8M0 scales [R, D/32] uint8), power-of-two scale per 32 lanes."""
    rows, dim = weight.shape
    if dim % FP8_BLOCK:
        raise ValueError(f"quantize_rows_e8m0: row width {dim} is not a multiple of {FP8_BLOCK}")
    blocks = weight.float().reshape(rows, dim // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = torch.ceil(torch.log2(amax / _E4M3_MAX)).clamp(-127, 127)
    values = (blocks / torch.exp2(exponent).unsqueeze(-1)).reshape(rows, dim).to(torch.float8_e4m3fn)
    return values, (exponent + 127).to(torch.uint8)


def dequantize_rows_e8m0(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 rows [N, D] × E8M0 scales [N, D/32] -> rows [N, D] in `dtype`: float(v) · 2^(s − 127)."""
    if values.device.type == "cpu" and values.numel() and dtype in (torch.float32, torch.bfloat16, torch.float16):
        # torch's CPU fp8 -> fp32 cast is a scalar loop; the bridge codec decodes the same values ~20× faster
        from dsv4flash_bridge.codecs import decode_engram_fp8

        return decode_engram_fp8(values.reshape(-1, values.shape[-1]), scale.reshape(-1, scale.shape[-1]),
                                 dtype=dtype, name="engram host table rows").reshape(values.shape)
    factor = torch.exp2(scale.float() - 127.0)  # [N, D/32]
    blocks = values.float().unflatten(-1, (-1, FP8_BLOCK)) * factor.unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


@dataclass
class GatherStats:
    """What the last gather moved: requested row slots, distinct rows, bytes copied host -> device."""

    requested: int = 0
    unique: int = 0
    bytes_moved: int = 0


class HostTable:
    """One Engram table in host memory (pinned iff CUDA is available) with a deduplicating row gather.

    `weight` [rows, dim] is float, or E4M3 with `scale` [rows, dim/32] uint8 (E8M0). Not an nn.Module: the
    owning module keeps it out of `parameters()`, `buffers()` and every `_apply`.
    """

    def __init__(self, weight: torch.Tensor, scale: Optional[torch.Tensor] = None, *, name: str = "engram",
                 pin: Optional[bool] = None, trainable: bool = False, _mapped: Optional[str] = None) -> None:
        if weight.ndim != 2:
            raise ValueError(f"{name}: table must be [rows, dim], got {list(weight.shape)}")
        self.name = name
        self.fp8 = weight.dtype == torch.float8_e4m3fn
        if self.fp8 != (scale is not None):
            raise ValueError(f"{name}: an E4M3 table needs its E8M0 `scale` [rows, dim/{FP8_BLOCK}] and a float "
                             f"table takes none (got weight {weight.dtype}, scale "
                             f"{None if scale is None else scale.dtype})")
        if scale is not None and (scale.dtype != torch.uint8
                                  or tuple(scale.shape) != (weight.shape[0], weight.shape[1] // FP8_BLOCK)):
            raise ValueError(f"{name}: scale must be uint8 [{weight.shape[0]}, {weight.shape[1] // FP8_BLOCK}], "
                             f"got {scale.dtype} {list(scale.shape)}")
        if trainable and (self.fp8 or not weight.is_floating_point()):
            raise ValueError(f"{name}: sparse row updates need a float table; FP8 tables stay frozen")
        if trainable and _mapped is not None:
            raise ValueError(f"{name}: a table shared through {_mapped} is read by every rank of the node; sparse "
                             "updates need a private table")
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.mapped_path = _mapped
        # A file-backed table already filled by another rank is left alone by load_state_dict.
        self.skip_load = False
        if _mapped is None:
            self.weight = self._host(weight)
            self.scale = self._host(scale) if scale is not None else None
        else:  # `from_file` pins the shared pages in place; a pinned copy would defeat the sharing
            self.weight, self.scale = weight, scale
        self.trainable = trainable
        # What the host gather reads, resolved once: each stored tensor, or its 1-D integer view when its rows
        # are 1/2/4/8 bytes (the E8M0 scales). `weight`/`scale` are filled in place, never replaced.
        self._row_sources = [(t, element_view(t)) for t in (self.weight, self.scale) if t is not None]
        # None: dedup where it saves work (rows cross to a device, or FP8 rows are dequantized); see `_dedups`
        self.dedup: Optional[bool] = None
        self._counts = (0, 0)  # (requested, distinct) of the last gather: `stats`
        self._row_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._grad_lock = threading.Lock()
        self._staging: dict[str, torch.Tensor] = {}
        self._staging_ready: Any = None  # CUDA event: the last H2D copy out of the staging buffers is done

    @classmethod
    def empty(cls, rows: int, dim: int, dtype: torch.dtype, **kwargs: Any) -> "HostTable":
        """An uninitialised table allocated straight into (pinned) host memory, no device round trip."""
        pin = kwargs.pop("pin", None)
        pin = torch.cuda.is_available() if pin is None else pin
        weight = torch.empty(rows, dim, dtype=dtype, device="cpu", pin_memory=pin)
        scale = (torch.empty(rows, dim // FP8_BLOCK, dtype=torch.uint8, device="cpu", pin_memory=pin)
                 if dtype == torch.float8_e4m3fn else None)
        return cls(weight, scale, pin=pin, **kwargs)

    @classmethod
    def from_file(cls, path: Any, rows: int, dim: int, dtype: torch.dtype, *, create: bool = False,
                  **kwargs: Any) -> "HostTable":
        """A table in a shared mapping of `path` (e.g. under /dev/shm): one copy per node for all its ranks.

        Layout: the [rows, dim] values, then (E4M3 only) the [rows, dim/32] E8M0 scales. `create=True` sizes the
        file (the rank that loads the checkpoint); otherwise the file must exist with exactly that size, and
        `load_state_dict` leaves its content alone (`skip_load`). Pinned in place when CUDA is available.
        """
        import os

        elem = torch.empty(0, dtype=dtype).element_size()
        n_values = rows * dim * elem
        nbytes = n_values + (rows * (dim // FP8_BLOCK) if dtype == torch.float8_e4m3fn else 0)
        path = os.fspath(path)
        if create:
            with open(path, "wb") as handle:
                handle.truncate(nbytes)
        elif not os.path.exists(path) or os.path.getsize(path) != nbytes:
            size = os.path.getsize(path) if os.path.exists(path) else None
            raise ValueError(f"{kwargs.get('name', 'engram')}: shared table file {path} must exist with {nbytes} "
                             f"bytes ({rows} x {dim} {dtype}{' + E8M0 scales' if elem == 1 else ''}), found "
                             f"{'no file' if size is None else f'{size} bytes'}")
        buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        weight = buf[:n_values].view(dtype).view(rows, dim)
        scale = buf[n_values:].view(rows, dim // FP8_BLOCK) if dtype == torch.float8_e4m3fn else None
        table = cls(weight, scale, _mapped=path, **kwargs)
        table.skip_load = not create
        if table.pinned:
            _register_pinned(buf)  # once for the whole mapping: values and scales share a page
        return table

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        if self.pinned and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.contiguous()

    @property
    def rows(self) -> int:
        """Number of table rows."""
        return self.weight.shape[0]

    @property
    def dim(self) -> int:
        """Row width."""
        return self.weight.shape[1]

    @property
    def row_bytes(self) -> int:
        """Bytes moved per gathered row (values + scales)."""
        scale = self.dim // FP8_BLOCK if self.fp8 else 0
        return self.dim * self.weight.element_size() + scale

    @property
    def stats(self) -> GatherStats:
        """What the last gather moved (built on demand: the hot path only records two counts)."""
        requested, unique = self._counts
        return GatherStats(requested, unique, unique * self.row_bytes)

    # ---- lookup ----------------------------------------------------------------------------------
    def gather(self, row_ids: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
               dedup: Optional[bool] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """row_ids [...] int (any device) -> rows [..., dim] on that device (FP8: dequantized to `dtype`).

        With dedup each distinct row is gathered and moved once, in ascending row order, and expanded on the
        device (`dedup` None: `self.dedup`, whose default None dedups when the rows cross to a device or are
        dequantized from FP8, see `_dedups`). `out` [..., dim]: a preallocated result (reused across
        micro-batches it saves the first-touch page faults of a fresh large buffer; no autograd).
        """
        dtype = dtype or (torch.bfloat16 if self.fp8 else None)
        ids, inverse, values, scales = self._fetch(row_ids, dedup, dequantize=self.fp8)
        if self.fp8:
            rows = dequantize_rows_e8m0(values, scales, dtype)  # distinct rows only (with dedup)
        else:
            rows = values if dtype is None else values.to(dtype)
        if self.trainable and torch.is_grad_enabled():
            if out is not None:
                raise ValueError(f"{self.name}: gather(out=...) cannot record row gradients; pass out=None")
            rows = rows.detach().requires_grad_(True)
            rows.register_hook(self._grad_hook(ids.long()))  # int32 host ids stay int32 until here
        flat_out = None if out is None else _check_out(out, row_ids, self.dim, rows.dtype, self.name)
        if inverse is not None:
            rows = index_rows(rows, inverse, out=flat_out)
        elif flat_out is not None:
            rows = flat_out.copy_(rows)
        return rows.reshape(*row_ids.shape, self.dim)

    def gather_stored(self, row_ids: torch.Tensor, *, dedup: Optional[bool] = None,
                      out: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Like `gather` but in the stored format: (values [..., dim], E8M0 scales [..., dim/32] or None).

        `out`: preallocated (values, scales) of those shapes; on the host without dedup the rows are gathered
        straight into them (one plain gather per tensor, nothing intermediate) and `out` itself is returned; a
        bad id raises the named error with the buffers' contents undefined.
        """
        if out is not None and row_ids.device.type == "cpu" and not self._dedups(row_ids.device, dedup, False):
            return self._gather_stored_into(row_ids, out)
        outs = (None, None) if out is None else (
            _check_out(out[0], row_ids, self.dim, self.weight.dtype, self.name),
            None if self.scale is None else _check_out(out[1], row_ids, self.scale.shape[1], torch.uint8, self.name))
        _, inverse, values, scales = self._fetch(row_ids, dedup)
        if inverse is not None:
            values = index_rows(values, inverse, out=outs[0])
            scales = index_rows(scales, inverse, out=outs[1]) if scales is not None else None
        elif out is not None:  # rows fetched to a device without dedup
            values = outs[0].copy_(values)
            scales = outs[1].copy_(scales) if scales is not None else None
        shape = tuple(row_ids.shape)
        return values.reshape(*shape, self.dim), (scales.reshape(*shape, -1) if scales is not None else None)

    def _gather_stored_into(self, row_ids: torch.Tensor, out: tuple[torch.Tensor, Optional[torch.Tensor]]
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The host path without dedup: one `index_select` per stored tensor straight into the caller's buffers.

        Kept to the few calls it needs: a micro-batch starts from cold caches, where each extra Python step of
        the call costs misses too (measured, paired cold-cache rounds: the general path through `_fetch` cost
        40-65 us more a call, 2-3 % at 4096 tokens x 24 ids, 7 % at 1024)."""
        if row_ids.dtype not in _ID_DTYPES:
            raise self._id_dtype_error(row_ids)
        dsts = [_check_out(out[0], row_ids, self.dim, self.weight.dtype, self.name)]
        if self.scale is not None:
            dsts.append(_check_out(out[1], row_ids, self.scale.shape[1], torch.uint8, self.name))
        ids = row_ids.reshape(-1)  # int32 ids stay int32: index_select reads them as they are
        self._host_rows_into(ids, dsts)
        self._counts = (ids.numel(), ids.numel())
        return out[0], (out[1] if self.scale is not None else None)

    def _host_rows_into(self, ids: torch.Tensor, dsts: list[torch.Tensor]) -> None:
        """Host rows `ids` [n] of each stored tensor into `dsts` ([n, width] each), one `index_select` per tensor.

        index_select's own bounds check replaces a separate aminmax pass over all ids (~2 % of the gather): its
        IndexError becomes the named range error."""
        try:
            for (table, elements), dst in zip(self._row_sources, dsts):
                if elements is None:
                    torch.index_select(table, 0, ids, out=dst)
                else:
                    torch.index_select(elements, 0, ids, out=dst.view(elements.dtype).view(-1))
        except IndexError:
            error = self._range_error(ids)
            if error is None:
                raise
            raise error from None

    def _dedups(self, device: torch.device, dedup: Optional[bool], dequantize: bool) -> bool:
        """Whether a gather to `device` deduplicates its ids first.

        Dedup costs a sort of every id and a per-token expand; it pays when rows cross to a device (each
        distinct row is copied once) or are dequantized (each distinct row decoded once). When rows land on the
        host in the stored format neither applies: a repeated row is a cache hit, and one plain gather of
        every id is the fastest way to the per-token result (measured: `python -m dsv4flash.bench engram`).
        """
        if dedup is None:
            dedup = self.dedup
        if dedup is None:
            return device.type != "cpu" or dequantize
        return dedup

    def _fetch(self, row_ids: torch.Tensor, dedup: Optional[bool], dequantize: bool = False):
        """-> (host ids [n], inverse [N] on the device or None, values [n, dim], scales [n, dim/32] | None)."""
        if row_ids.dtype not in _ID_DTYPES:
            raise self._id_dtype_error(row_ids)
        device = row_ids.device
        flat = row_ids.reshape(-1)
        if self._dedups(device, dedup, dequantize):
            unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)  # on the device
            ids = unique.to("cpu", torch.int64)  # the only device -> host traffic: distinct ids
        elif device.type == "cpu":
            ids, inverse = flat, None  # int32 ids stay int32: index_select reads them as they are
        else:
            ids, inverse = flat.to("cpu", torch.int64), None
        if device.type != "cpu":
            error = self._range_error(ids)  # before any asynchronous copy starts (host gathers check their own)
            if error is not None:
                raise error
        values, scales = self._gather_host(ids, device)
        self._counts = (flat.numel(), ids.numel())
        return ids, inverse, values, scales

    def _id_dtype_error(self, row_ids: torch.Tensor) -> ValueError:
        return ValueError(f"{self.name}: row ids must be int32/int64, got {row_ids.dtype}")

    def _range_error(self, ids: torch.Tensor) -> Optional[ValueError]:
        """The named error if any host id lies outside [0, rows), else None."""
        if ids.numel():
            lo, hi = (int(v) for v in ids.aminmax())
            if lo < 0 or hi >= self.rows:
                return ValueError(f"{self.name}: row ids must lie in [0, {self.rows}), got range [{lo}, {hi}]")
        return None

    def _gather_host(self, ids: torch.Tensor, device: torch.device):
        """Host rows `ids` -> device tensors. Crossing to CUDA, chunks are gathered into a reused pinned staging
        buffer while the previous chunk's asynchronous copy is in flight, so gather and copy overlap."""
        if device.type == "cpu":
            out = [torch.empty(ids.numel(), t.shape[1], dtype=t.dtype) for t, _ in self._row_sources]
            self._host_rows_into(ids, out)
            return out[0], (out[1] if self.fp8 else None)
        tables = [t for t, _ in self._row_sources]
        if self._staging_ready is not None:
            self._staging_ready.synchronize()  # the previous micro-batch's copies may still read the buffers
        n = ids.numel()
        staging, out = [], []
        for key, table in zip(("weight", "scale"), tables):
            buf = self._staging.get(key)
            if buf is None or buf.shape[0] < n:
                cap = max(n, 2 * (0 if buf is None else buf.shape[0]))
                buf = torch.empty(cap, table.shape[1], dtype=table.dtype, pin_memory=self.pinned)
                self._staging[key] = buf
            staging.append(buf)
            out.append(torch.empty(n, table.shape[1], dtype=table.dtype, device=device))
        chunk = max(_MIN_CHUNK_ROWS, -(-n // _CHUNKS))
        for start in range(0, n, chunk):
            part = slice(start, min(n, start + chunk))
            for table, buf, dst in zip(tables, staging, out):
                index_rows(table, ids[part], out=buf[part])
                dst[part].copy_(buf[part], non_blocking=self.pinned)
        self._staging_ready = torch.cuda.Event()
        self._staging_ready.record()
        return out[0], (out[1] if self.fp8 else None)

    # ---- sparse training -------------------------------------------------------------------------
    def _grad_hook(self, ids: torch.Tensor):
        def hook(grad: torch.Tensor) -> None:
            with self._grad_lock:
                self._row_grads.append((ids, grad.detach().to("cpu", torch.float32)))
        return hook

    def pop_row_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Coalesced (row ids [n], grads [n, dim] fp32) of every backward since the last call; clears them."""
        with self._grad_lock:
            pending, self._row_grads = self._row_grads, []
        if not pending:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.dim)
        return coalesce_rows(torch.cat([p[0] for p in pending]), torch.cat([p[1] for p in pending]))


def _check_out(out: torch.Tensor, row_ids: torch.Tensor, width: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A caller's preallocated result [..., width] for `row_ids`, as a flat contiguous [N, width] view."""
    want = (*row_ids.shape, width)
    if tuple(out.shape) != want or out.dtype != dtype or out.device != row_ids.device or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous {dtype} {list(want)} tensor on {row_ids.device}, got "
                         f"{'' if out.is_contiguous() else 'non-contiguous '}{out.dtype} {list(out.shape)} on "
                         f"{out.device}")
    return out.view(-1, width)


def _register_pinned(*tensors: Optional[torch.Tensor]) -> None:
    """Page-lock existing host memory for asynchronous copies (cudaHostRegister), without moving it."""
    cudart = torch.cuda.cudart()
    for tensor in tensors:
        if tensor is None or tensor.numel() == 0:
            continue
        code = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of {tensor.numel() * tensor.element_size()} bytes failed "
                               f"(cudaError {int(code)}); raise the locked-memory limit or pass pin=False")


def coalesce_rows(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradient rows of repeated ids: -> (sorted distinct ids, summed grads)."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)
    return unique, summed
