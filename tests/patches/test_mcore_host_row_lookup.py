"""DSV41-MCORE-006: `HostRowLookupTable`, a row-lookup table kept in host memory (sparse host gradient).

The stock test shows 0.19.2 has no such module. The `patch_form` tests run twice: with the runtime twin
providing the module on the installed megatron-core, and in a subprocess on a copy of the pinned release with
the format-patch applied (where the module is a real file); both must pass and record identical values.
"""

from __future__ import annotations

import pytest
import torch

PATCH_ID = "DSV41-MCORE-006"
MODULE = "megatron.core.models.common.embeddings.host_embedding"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


def _table_class():
    import importlib

    return importlib.import_module(MODULE).HostRowLookupTable


def test_stock_release_has_no_host_table():
    import importlib

    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        with pytest.raises(ImportError):
            importlib.import_module(MODULE)


def test_gather_and_sparse_gradient(patch_form):
    torch.manual_seed(31)
    table = _table_class()(32, 8)
    ids = torch.tensor([[3, 1, 3, 9], [7, 1, 0, 9]])  # [b, s]
    out = table(ids)  # [b, s, d]
    assert out.shape == (2, 4, 8)
    torch.testing.assert_close(out, table.weight.detach()[ids])
    weights = torch.arange(8.0).expand(2, 4, 8)
    (out * weights).sum().backward()
    grad = table.weight.grad
    assert grad.is_sparse and grad._indices()[0].tolist() == [0, 1, 3, 7, 9]  # each distinct row once
    dense = torch.zeros(32, 8).index_add_(0, ids.reshape(-1), weights.reshape(-1, 8))
    torch.testing.assert_close(grad.to_dense(), dense)
    patch_form.record("rows", out, atol=1e-7)
    patch_form.record("grad_rows", grad._indices(), atol=0)
    patch_form.record("grad_values", grad._values(), atol=1e-6)


def test_table_stays_on_host_and_out_of_ddp(patch_form, mcore_parallel):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module, MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True,
                               params_dtype=torch.float32, use_cpu_initialization=True)
    table_class = _table_class()

    class Model(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.proj = torch.nn.Linear(8, 8, bias=False)
            self.table = table_class(16, 8)

        def forward(self, x, ids):
            return self.proj(x) + self.table(ids).to(x.dtype)

    inner = Model()
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), Float16Module(config, inner))
    weight = inner.table.weight
    assert weight.dtype == torch.float32 and inner.proj.weight.dtype == torch.bfloat16  # cast skipped the table
    assert weight.host_resident and weight not in model.param_to_bucket_group
    out = model(torch.randn(3, 8, dtype=torch.bfloat16), torch.tensor([4, 4, 2]))
    out.float().sum().backward()
    assert weight.grad.is_sparse and sorted(weight.grad.coalesce().indices()[0].tolist()) == [2, 4]
    patch_form.record("grad_rows", sorted(weight.grad.coalesce().indices()[0].tolist()))


def test_sparse_adam_updates_only_touched_rows(patch_form):
    torch.manual_seed(32)
    table = _table_class()(8, 4)
    before = table.weight.detach().clone()
    optimizer = torch.optim.SparseAdam([table.weight], lr=0.1)
    table(torch.tensor([2, 5, 5])).square().sum().backward()
    optimizer.step()
    changed = (table.weight.detach() != before).any(dim=1)
    assert changed.tolist() == [False, False, True, False, False, True, False, False]
    patch_form.record("weight", table.weight, atol=1e-6)
