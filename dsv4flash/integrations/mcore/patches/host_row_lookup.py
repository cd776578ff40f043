"""Runtime twin of DSV41-MCORE-006: `HostRowLookupTable`, a row-lookup table kept in (pinned) host memory.

Why: megatron-core 0.19.x has no module for a lookup table far larger than device memory (an Engram-style
n-gram table): every embedding lives on the device, `model.cuda()` / `Float16Module` move and cast every
parameter, and a dense gradient of the whole table would not fit either.

How: the format-patch adds `megatron/core/models/common/embeddings/host_embedding.py`; this twin provides
the same module (the classes below, identical to the patch's) under that import name on a stock install.
`forward(ids)` gathers each distinct row once on the host and copies it to the ids' device (pinned,
asynchronous); the backward returns a coalesced sparse host gradient for a host-side sparse optimizer. The
parameter is marked `host_resident` (DSV41-MCORE-005), and `_apply` keeps it on the host in its dtype. The
runtime Engram storage (`dsv4flash.integrations.mcore.host_table.HostTable`: E4M3 rows, file-backed shared
tables, chunk-pipelined gathers) is a superset and stays separate until that module is refactored.
"""

from __future__ import annotations

import types
from typing import Callable, Optional

import torch

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin

MODULE = "megatron.core.models.common.embeddings.host_embedding"
TOUCHES = (f"{MODULE}.HostRowLookupTable",)


class _HostRowLookup(torch.autograd.Function):
    """Gather rows of a host table onto the device of the ids; backward yields a sparse host gradient."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """weight [num_rows, dim] on the host, ids [...] on any device -> rows [..., dim] on that device."""
        # Each distinct row crosses the host-device link once, whatever the batch repeats.
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        host_ids = unique.to(weight.device)
        rows = weight.index_select(0, host_ids)  # [num_unique, dim], host
        if ids.device.type == "cuda":
            rows = rows.pin_memory().to(ids.device, non_blocking=True)
        ctx.save_for_backward(host_ids, inverse)
        ctx.table_shape = weight.shape
        return rows.index_select(0, inverse).reshape(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """grad_output [..., dim] -> a coalesced sparse [num_rows, dim] gradient on the host."""
        host_ids, inverse = ctx.saved_tensors
        dim = ctx.table_shape[1]
        grad = grad_output.reshape(-1, dim)
        per_row = torch.zeros(host_ids.numel(), dim, dtype=grad.dtype, device=grad.device)
        per_row.index_add_(0, inverse, grad)  # [num_unique, dim]
        values = per_row.to(host_ids.device)
        sparse = torch.sparse_coo_tensor(
            host_ids.unsqueeze(0), values, ctx.table_shape, is_coalesced=True
        )
        return sparse, None


class HostRowLookupTable(torch.nn.Module):
    """A [num_rows, dim] parameter kept in host memory (pinned when CUDA is available).

    forward(ids) gathers the distinct requested rows to the device of ids and returns
    [..., dim]. The gradient is a sparse COO tensor on the host, so a host-side sparse
    optimizer (for example torch.optim.SparseAdam) updates only the touched rows. The parameter
    is marked host_resident: DistributedDataParallel and the Megatron optimizer leave it alone,
    and moving or casting the model (.cuda(), .to(), .bfloat16()) does not move or cast it.

    Args:
        num_rows (int): Number of rows.
        dim (int): Row width.
        dtype (torch.dtype): Storage dtype of the table.
        init_method (callable, optional): Initialises the [num_rows, dim] weight in place.
            Defaults to a normal distribution with std 0.02.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        dtype: torch.dtype = torch.float32,
        init_method: Optional[Callable[[torch.Tensor], None]] = None,
    ):
        super().__init__()
        weight = torch.empty(num_rows, dim, dtype=dtype)
        if init_method is None:
            torch.nn.init.normal_(weight, std=0.02)
        else:
            init_method(weight)
        if torch.cuda.is_available():
            weight = weight.pin_memory()
        self.weight = torch.nn.Parameter(weight)
        self.weight.host_resident = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] (int64) -> rows [..., dim] on the device of ids."""
        return _HostRowLookup.apply(self.weight, ids)

    def _apply(self, fn, recurse=True):
        # The table stays in host memory in its own dtype when the model is moved or cast.
        return self


def upstream_has_host_row_lookup() -> bool:
    """Probe: does the installed megatron-core ship a HostRowLookupTable that gathers rows and marks them?"""
    import importlib

    from dsv4flash.patching.twins import MARKER

    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return False
    if getattr(module, MARKER, None):  # this twin's stand-in, not upstream
        return False
    table = module.HostRowLookupTable(4, 2)
    rows = table(torch.tensor([2, 2, 0]))
    return bool(table.weight.host_resident) and torch.equal(rows, table.weight.detach()[[2, 2, 0]])


@mcore_twin(
    patch_id="DSV41-MCORE-006",
    versions=">=0.19.0,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_HOST_ROW_LOOKUP",
    tests=("tests/patches/test_mcore_host_row_lookup.py",),
    depends_on=("DSV41-MCORE-005",),
    upstream_has_it=upstream_has_host_row_lookup,
)
def install(patcher: Patcher) -> None:
    """Provide megatron.core.models.common.embeddings.host_embedding on a stock install."""
    module = types.ModuleType(MODULE, "A row-lookup table kept in host memory (dsv4flash runtime twin DSV41-MCORE-006).")
    module.HostRowLookupTable = HostRowLookupTable
    module._HostRowLookup = _HostRowLookup
    patcher.provide_module(MODULE, module)
