"""CPU-pinned Engram for megatron-core: the two ~98 GB tables stay in host memory, rows are gathered per micro-batch.

The table is deliberately *not* a parameter or a buffer of the module: it is a plain attribute holding a host
tensor (pinned when CUDA is available, plain host memory otherwise: one code path). `nn.Module._apply` only
visits parameters and buffers, so `.cuda()`, `.to()`, `Float16Module`'s `.bfloat16()` never move or cast it,
and DDP bucketing, `broadcast_params` and the distributed optimizer (which all walk `parameters()`) never see
it. It still appears in `state_dict()` under the release name `embed.weight` (+ `embed.scale` for FP8), and
`load_state_dict` copies into the existing host tensor in place.

Per micro-batch, `HostTable.gather` deduplicates the row ids on their device (`torch.unique`), copies only the
distinct ids to the host, gathers those rows chunk by chunk into a pinned staging buffer while the previous
chunk's asynchronous copy to the device is in flight, and expands them there with the inverse index, so the
per-token routing metadata never leaves the device. The same path runs when the "device" is the host (CPU-only
machines): sorting and deduplicating still pays there, because ascending rows stream out of the table.
FP8 tables (E4M3 rows + per-32-lane E8M0 scales, the release format) move 264 B per row and are dequantized on
the device.

Training of the rows: frozen by default (LoRA fine-tuning never touches them). With `trainable=True` each
gather hands back a leaf of the unique rows; its gradient is copied to the host in backward, and
`SparseRowSGD.step()` all-gathers the touched rows' gradients over the data-parallel group, averages them like
DDP does, and applies `w[rows] -= lr · g` on the host table. (The TR trains the tables with a
Sinkhorn-balanced momentum update and 5× LR; this is the plain sparse-SGD form of that, not a replica.)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from dsv4flash.model.engram import Engram

__all__ = ["HostTable", "GatherStats", "PinnedEngram", "SparseRowSGD", "index_rows", "quantize_rows_e8m0",
           "dequantize_rows_e8m0"]

FP8_BLOCK = 32  # Engram rows carry one E8M0 scale per 32 lanes (quant_plan ENGRAM_FP8)
# Host gather -> device copy pipelining: about this many chunks, none smaller than this many rows.
_CHUNKS = 8
_MIN_CHUNK_ROWS = 4096
_E4M3_MAX = 448.0


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def index_rows(table: torch.Tensor, ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`table.index_select(0, ids)` for a 2-D table; rows of 1/2/4/8 bytes (the E8M0 scales) go through a
    1-D integer view, which takes torch's element kernel instead of its ~10x slower narrow-row path."""
    width = table.shape[1] * table.element_size()
    as_int = _INT_VIEWS.get(width)
    if as_int is None or not table.is_contiguous():
        return torch.index_select(table, 0, ids, out=out)
    flat_out = None if out is None else out.view(as_int).reshape(-1)
    rows = torch.index_select(table.view(as_int).reshape(-1), 0, ids, out=flat_out)
    return rows.view(table.dtype).reshape(-1, table.shape[1])


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
                 pin: Optional[bool] = None, trainable: bool = False) -> None:
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
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.weight = self._host(weight)
        self.scale = self._host(scale) if scale is not None else None
        self.trainable = trainable
        self.dedup = True  # gather each distinct row once, in sorted order (see `gather`)
        self.stats = GatherStats()
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

    # ---- lookup ----------------------------------------------------------------------------------
    def gather(self, row_ids: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
               dedup: Optional[bool] = None) -> torch.Tensor:
        """row_ids [...] int (any device) -> rows [..., dim] on that device (FP8: dequantized to `dtype`).

        With `dedup` (default `self.dedup`, True) each distinct row is gathered and moved once, in ascending
        row order, and expanded on the device. Sorted access is also what makes the host gather fast: random
        256-byte rows out of a ~100 GB table are TLB- and DRAM-latency-bound, ascending ones stream.
        """
        ids, inverse, values, scales = self._fetch(row_ids, dedup)
        if self.fp8:
            rows = dequantize_rows_e8m0(values, scales, dtype or torch.bfloat16)  # distinct rows only
        else:
            rows = values if dtype is None else values.to(dtype)
        if self.trainable and torch.is_grad_enabled():
            rows = rows.detach().requires_grad_(True)
            rows.register_hook(self._grad_hook(ids))
        if inverse is not None:
            rows = index_rows(rows, inverse)
        return rows.reshape(*row_ids.shape, self.dim)

    def gather_stored(self, row_ids: torch.Tensor, *, dedup: Optional[bool] = None
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Like `gather` but in the stored format: (values [..., dim], E8M0 scales [..., dim/32] or None)."""
        _, inverse, values, scales = self._fetch(row_ids, dedup)
        if inverse is not None:
            values = index_rows(values, inverse)
            scales = index_rows(scales, inverse) if scales is not None else None
        shape = tuple(row_ids.shape)
        return values.reshape(*shape, self.dim), (scales.reshape(*shape, -1) if scales is not None else None)

    def _fetch(self, row_ids: torch.Tensor, dedup: Optional[bool]):
        """-> (host ids [n], inverse [N] on the device or None, values [n, dim], scales [n, dim/32] | None)."""
        if row_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{self.name}: row ids must be int32/int64, got {row_ids.dtype}")
        device = row_ids.device
        flat = row_ids.reshape(-1)
        if dedup if dedup is not None else self.dedup:
            unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)  # on the device
            ids = unique.to("cpu", torch.int64)  # the only device -> host traffic: distinct ids
        else:
            ids, inverse = flat.to("cpu", torch.int64), None
        if ids.numel():
            lo, hi = (int(v) for v in ids.aminmax())
            if lo < 0 or hi >= self.rows:
                raise ValueError(f"{self.name}: row ids must lie in [0, {self.rows}), got range [{lo}, {hi}]")
        values, scales = self._gather_host(ids, device)
        self.stats = GatherStats(flat.numel(), ids.numel(), ids.numel() * self.row_bytes)
        return ids, inverse, values, scales

    def _gather_host(self, ids: torch.Tensor, device: torch.device):
        """Host rows `ids` -> device tensors. Crossing to CUDA, chunks are gathered into a reused pinned staging
        buffer while the previous chunk's asynchronous copy is in flight, so gather and copy overlap."""
        tables = [t for t in (self.weight, self.scale) if t is not None]
        if device.type == "cpu":
            out = [index_rows(t, ids) for t in tables]
            return out[0], (out[1] if self.fp8 else None)
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


def coalesce_rows(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradient rows of repeated ids: -> (sorted distinct ids, summed grads)."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)
    return unique, summed


class PinnedEngram(Engram):
    """The reference Engram layer with its table in host memory (`table`, a `HostTable`), not in parameters.

    Constructors: `PinnedEngram(cfg, engram_index, dtype=..., device=...)` with a `DSV41FlashConfig`, or as a
    megatron-core spec module `PinnedEngram(config, engram_index)` where `config.dsv4` is that config (the
    CSA2 layer's `engram=` slot). `table_dtype` is the host storage (float, or `torch.float8_e4m3fn` for the
    release's E4M3 + E8M0 rows). Forward, gate and `wkv` are the reference's own code.
    """

    def __init__(self, cfg: Any, engram_index: int, dtype: Optional[torch.dtype] = None, device: Any = None, *,
                 table_dtype: Optional[torch.dtype] = None, trainable_table: bool = False,
                 pin: Optional[bool] = None, **_megatron_kwargs: Any) -> None:
        if hasattr(cfg, "dsv4"):  # a megatron-core TransformerConfig carrying the V4.1 config
            dtype = dtype or cfg.params_dtype
            cfg = cfg.dsv4
        dtype = dtype or torch.float32
        # Build the small parts exactly as the reference does, the table only as a shape (meta).
        super().__init__(cfg, engram_index, dtype=dtype, device="meta")
        del self.embed
        self.to_empty(device=device if device is not None else "cpu")
        table_dtype = table_dtype or dtype
        self.table = HostTable.empty(self.num_rows, self.head_dim, table_dtype, pin=pin,
                                     name=f"Engram layer {self.layer_id} table", trainable=trainable_table)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fresh init as the reference: table and wkv ~ N(0, initializer_range), q/k weights 1."""
        if self.wkv.weight.is_meta:  # called from the reference __init__, before the real tensors exist
            return
        nn.init.normal_(self.wkv.weight, mean=0.0, std=self.init_std)
        nn.init.ones_(self.q_weight)
        nn.init.ones_(self.k_weight)
        table = getattr(self, "table", None)
        if table is not None:
            if table.fp8:
                values, scale = quantize_rows_e8m0(torch.randn(table.rows, table.dim) * self.init_std)
                table.weight.copy_(values)
                table.scale.copy_(scale)
            else:
                table.weight.normal_(mean=0.0, std=self.init_std)

    def lookup_rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        """row_ids [B,S,n_cols] (device) -> rows [B,S,n_cols,head_dim] on that device, gathered from the host."""
        return self.table.gather(row_ids, dtype=self.wkv.weight.dtype if self.table.fp8 else None)

    # ---- checkpoints: the table keeps its release name, `embed.weight` (+ `embed.scale`) -------------
    def _table_keys(self, prefix: str) -> dict[str, Optional[torch.Tensor]]:
        keys = {prefix + "embed.weight": self.table.weight}
        if self.table.fp8:
            keys[prefix + "embed.scale"] = self.table.scale
        return keys

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Parameters as usual, plus the host table under its release name (no copy)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination.update(self._table_keys(prefix))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Copy the table keys into the existing host tensors (pinning kept); the rest goes the usual way."""
        mine = self._table_keys(prefix)
        for key, target in mine.items():
            if key not in state_dict:
                missing_keys.append(key)
                continue
            source = state_dict[key]
            if tuple(source.shape) != tuple(target.shape) or source.dtype != target.dtype:
                error_msgs.append(f"{key}: expected {target.dtype} {list(target.shape)} (host table of Engram "
                                  f"layer {self.layer_id}), got {source.dtype} {list(source.shape)}")
                continue
            with torch.no_grad():
                target.copy_(source)
        rest = {k: v for k, v in state_dict.items() if k not in mine}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        """Reference summary plus where and how the table is stored."""
        kind = "fp8+e8m0" if self.table.fp8 else str(self.table.weight.dtype).replace("torch.", "")
        return (f"{super().extra_repr()}, table=host[{kind}{', pinned' if self.table.pinned else ''}"
                f"{', trainable' if self.table.trainable else ''}]")


class SparseRowSGD:
    """Sparse SGD on host tables: `w[rows] -= lr · mean_dp(g)` for the rows touched since the last step."""

    def __init__(self, tables: Iterable[HostTable], lr: float, dp_group: Any = None) -> None:
        self.tables = list(tables)
        if not self.tables or not all(t.trainable for t in self.tables):
            raise ValueError("SparseRowSGD: pass one or more HostTable(trainable=True)")
        self.lr = lr
        self.dp_group = dp_group

    @classmethod
    def for_module(cls, module: nn.Module, lr: float, dp_group: Any = None) -> "SparseRowSGD":
        """Collect every trainable `PinnedEngram` table under `module`."""
        tables = [m.table for m in module.modules() if isinstance(m, PinnedEngram) and m.table.trainable]
        return cls(tables, lr, dp_group)

    def zero_grad(self) -> None:
        """Drop the row gradients collected so far."""
        for table in self.tables:
            table.pop_row_grads()

    @torch.no_grad()
    def step(self) -> None:
        """Average the touched rows' gradients over the data-parallel group, then update the host rows."""
        for table in self.tables:
            ids, grads = table.pop_row_grads()
            ids, grads, world = self._all_gather(ids, grads)
            if ids.numel():
                ids, grads = coalesce_rows(ids, grads)
                table.weight.index_add_(0, ids, (grads / world).to(table.weight.dtype), alpha=-self.lr)

    def _all_gather(self, ids: torch.Tensor, grads: torch.Tensor):
        import torch.distributed as dist

        group = self.dp_group
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return ids, grads, 1
        world = dist.get_world_size(group)
        # Variable-length rows per rank: gather the counts, pad to the longest, trim after.
        count = torch.tensor([ids.numel()], dtype=torch.int64)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=group)
        longest = int(max(c.item() for c in counts))
        pad_ids = torch.zeros(longest, dtype=torch.int64)
        pad_ids[: ids.numel()] = ids
        pad_grads = torch.zeros(longest, grads.shape[1], dtype=grads.dtype)
        pad_grads[: ids.numel()] = grads
        all_ids = [torch.empty_like(pad_ids) for _ in range(world)]
        all_grads = [torch.empty_like(pad_grads) for _ in range(world)]
        dist.all_gather(all_ids, pad_ids, group=group)
        dist.all_gather(all_grads, pad_grads, group=group)
        keep = [slice(0, int(c.item())) for c in counts]
        return (torch.cat([i[k] for i, k in zip(all_ids, keep)]),
                torch.cat([g[k] for g, k in zip(all_grads, keep)]), world)
