"""CPU-pinned Engram for megatron-core: the two ~98 GB tables stay in host memory, rows are gathered per micro-batch.

The table is deliberately *not* a parameter or a buffer of the module: it is a plain attribute holding a host
tensor (pinned when CUDA is available, plain host memory otherwise: one code path). `nn.Module._apply` only
visits parameters and buffers, so `.cuda()`, `.to()`, `Float16Module`'s `.bfloat16()` never move or cast it,
and DDP bucketing, `broadcast_params` and the distributed optimizer (which all walk `parameters()`) never see
it. It still appears in `state_dict()` under the release name `embed.weight` (+ `embed.scale` for FP8), and
`load_state_dict` copies into the existing host tensor in place.

Per micro-batch, `HostTable.gather` (`host_table.py`) moves only the distinct rows and leaves the per-token
metadata on the device. FP8 tables (E4M3 rows + per-32-lane E8M0 scales, the release format) move 264 B per row
and are dequantized on the device. Every rank holds its own host copy unless `table_file` maps one shared copy
per node (8 ranks × 2 tables × ~101 GB would not fit a node otherwise).

Training of the rows: frozen by default (LoRA fine-tuning never touches them). With `trainable=True` each
gather hands back a leaf of the unique rows; its gradient is copied to the host in backward, and
`SparseRowSGD.step()` all-gathers the touched rows' gradients over the data-parallel group, averages them like
DDP does, and applies `w[rows] -= lr · g` on the host table. (The TR trains the tables with a
Sinkhorn-balanced momentum update and 5× LR; this is the plain sparse-SGD form of that, not a replica.)
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from dsv4flash.integrations.mcore.host_table import (
    FP8_BLOCK,
    GatherStats,
    HostTable,
    coalesce_rows,
    dequantize_rows_e8m0,
    index_rows,
    quantize_rows_e8m0,
)
from dsv4flash.model.engram import Engram

__all__ = ["FP8_BLOCK", "GatherStats", "HostTable", "PinnedEngram", "SparseRowSGD", "dequantize_rows_e8m0",
           "index_rows", "quantize_rows_e8m0"]


class PinnedEngram(Engram):
    """The reference Engram layer with its table in host memory (`table`, a `HostTable`), not in parameters.

    Constructors: `PinnedEngram(cfg, engram_index, dtype=..., device=...)` with a `DSV41FlashConfig`, or as a
    megatron-core spec module `PinnedEngram(config, engram_index)` where `config.dsv4` is that config (the
    CSA2 layer's `engram=` slot; pass options with `functools.partial`). `table_dtype` is the host storage
    (float, or `torch.float8_e4m3fn` for the release's E4M3 + E8M0 rows). `table_file` (e.g.
    "/dev/shm/dsv4_engram_{layer}.bin") maps one copy per node: the rank with `create_table_file=True` sizes
    and loads it, the others attach after it (a node barrier) and skip the table on load. Forward, gate and
    `wkv` are the reference's own code.
    """

    def __init__(self, cfg: Any, engram_index: int, dtype: Optional[torch.dtype] = None, device: Any = None, *,
                 table_dtype: Optional[torch.dtype] = None, trainable_table: bool = False,
                 pin: Optional[bool] = None, table_file: Optional[str] = None, create_table_file: bool = False,
                 **_megatron_kwargs: Any) -> None:
        if hasattr(cfg, "dsv4"):  # a megatron-core TransformerConfig carrying the V4.1 config
            dtype = dtype or cfg.params_dtype
            cfg = cfg.dsv4
        dtype = dtype or torch.float32
        # Build the small parts exactly as the reference does, the table only as a shape (meta).
        super().__init__(cfg, engram_index, dtype=dtype, device="meta")
        del self.embed
        self.to_empty(device=device if device is not None else "cpu")
        table_dtype = table_dtype or dtype
        name = f"Engram layer {self.layer_id} table"
        if table_file is not None:  # `{layer}` in the path is this Engram layer's id
            self.table = HostTable.from_file(table_file.format(layer=self.layer_id), self.num_rows, self.head_dim,
                                             table_dtype, create=create_table_file, pin=pin, name=name,
                                             trainable=trainable_table)
        else:
            self.table = HostTable.empty(self.num_rows, self.head_dim, table_dtype, pin=pin, name=name,
                                         trainable=trainable_table)
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
        if table is not None and not table.skip_load:  # never overwrite a shared table another rank filled
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
        """Copy the table keys into the existing host tensors (pinning kept); the rest goes the usual way.

        A shared table attached with `create_table_file=False` is filled by the rank that created it: its keys
        are accepted and ignored here."""
        mine = self._table_keys(prefix)
        for key, target in mine.items():
            if self.table.skip_load:
                continue
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
        table = self.table
        kind = "fp8+e8m0" if table.fp8 else str(table.weight.dtype).replace("torch.", "")
        flags = [kind] + [f for f, on in (("pinned", table.pinned), ("trainable", table.trainable),
                                          (f"shared {table.mapped_path}", table.mapped_path)) if on]
        return f"{super().extra_repr()}, table=host[{', '.join(flags)}]"


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
