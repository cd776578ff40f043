"""DSV41-MCORE-005: DDP and the Megatron optimizer skip parameters marked `host_resident` (2 gloo ranks).

Each rank builds a MegatronModule with a linear layer and a `host_resident` row-lookup table parameter, wraps
it in megatron-core's DistributedDataParallel (with and without the distributed optimizer), broadcasts,
runs forward/backward and one optimizer step. The table must stay out of the grad buffers, the broadcast and
the optimizer (each rank keeps its own table and its local gradient), while the linear layer is synchronised
and updated as usual. In `[runtime]` each rank applies the twin; in `[series]` the ranks run the patched copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.mcore.test_engram_pinned import cuda_type_names
from tests.mcore_cpu import parallel as mcore_parallel

PATCH_ID = "DSV41-MCORE-005"
pytestmark = [pytest.mark.patches, pytest.mark.upstream, pytest.mark.whole_machine]

ROWS, HIDDEN = 16, 8


def _model(config):
    from megatron.core.transformer.module import MegatronModule

    class WithHostTable(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.linear = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.table = torch.nn.Parameter(torch.randn(ROWS, HIDDEN))  # [rows, h], kept on the host
            self.table.host_resident = True

        def forward(self, x, rows):  # x [t, h], rows [t] -> [t, h]
            return self.linear(x) + self.table[rows]

    return WithHostTable()


def _rank(rank: int, world_size: int, distributed_optimizer: bool, form: str, out_dir: str) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dsv4flash.patching import twins
    from tests.mcore_cpu import parallel

    twin = twins.discover().get(PATCH_ID)
    if form == "runtime":
        assert twin.apply().active, "the runtime twin did not apply in the rank"
    else:
        assert not twin.applied and twin.upstream_has_it(), "the rank does not run the patched copy"
    with cuda_type_names(), parallel.model_parallel(rank=rank, world_size=world_size, seed=1):
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1,
                                   params_dtype=torch.float32, use_cpu_initialization=True)
        torch.manual_seed(10 + rank)  # every tensor differs per rank until broadcast_params
        inner = _model(config)
        table, own_table = inner.table, inner.table.detach().clone()
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer), inner)
        assert table not in model.param_to_bucket_group and inner.linear.weight in model.param_to_bucket_group
        assert not hasattr(table, "main_grad") and table.requires_grad
        model.broadcast_params()
        assert torch.equal(table.detach(), own_table)  # not overwritten by rank 0's table
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=distributed_optimizer), [model])
        assert all(p is not table for group in optimizer.param_groups for p in group["params"])
        linear_before = inner.linear.weight.detach().clone()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        gen = torch.Generator().manual_seed(20 + rank)
        rows = torch.randint(0, ROWS, (6,), generator=gen)
        model(torch.randn(6, HIDDEN, generator=gen), rows).square().sum().backward()
        model.finish_grad_sync()
        assert optimizer.step()[0]
        touched = torch.zeros(ROWS, dtype=torch.bool)
        touched[rows] = True
        assert table.grad is not None and table.grad[touched].abs().sum() > 0 and not table.grad[~touched].any()
        assert torch.equal(table.detach(), own_table)  # the owner updates it, not the Megatron optimizer
        assert not torch.equal(inner.linear.weight.detach(), linear_before)
        result = {"table_grad": table.grad.tolist(), "linear": inner.linear.weight.detach().tolist(),
                  "main_grad": inner.linear.weight.main_grad.tolist()}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def test_stock_ddp_buckets_a_host_resident_param(mcore_parallel):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1,
                                   params_dtype=torch.float32, use_cpu_initialization=True)
        inner = _model(config)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), inner)
        assert inner.table in model.param_to_bucket_group and hasattr(inner.table, "main_grad")


@pytest.mark.slow
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_host_resident_param_stays_out_of_ddp_and_optimizer(patch_form, tmp_path, distributed_optimizer):
    mcore_parallel.spawn_gloo(_rank, 2, distributed_optimizer, patch_form.name, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["linear"] == ranks[1]["linear"]  # synchronised parameter, same update on both ranks
    if not distributed_optimizer:  # all-reduced; the distributed optimizer reduce-scatters into shards
        assert ranks[0]["main_grad"] == ranks[1]["main_grad"]
    assert ranks[0]["table_grad"] != ranks[1]["table_grad"]  # local gradients, never all-reduced
    patch_form.record("table_grads", [r["table_grad"] for r in ranks], atol=1e-6)
    patch_form.record("linear", ranks[0]["linear"], atol=1e-6)
    patch_form.record("main_grad", ranks[0]["main_grad"], atol=1e-6)
