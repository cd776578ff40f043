"""Resume across layouts: a checkpoint of a PP = 1 run (LoRA adapter + megatron-core's Adam, full
recompute) saved with megatron-core's distributed checkpointing and loaded by a PP = 2 run continues
bit-identically to the uninterrupted PP = 1 run.

Both runs build the same model (tiny, reference weights, a Megatron-Bridge LoRA on every layer with values
seeded by global name), wrap it in megatron-core's DDP and optimizer (`get_megatron_optimizer`), and take
the same micro-batches through megatron-core's schedules. The checkpoint holds the model's and the
optimizer's sharded state dicts (adapter weights, Adam moments and step, keyed like their parameters by
global layer); each PP = 2 stage loads its own layers' part. (megatron-core 0.19's distributed optimizer
cannot reshard here: its 'fully_reshardable' load with torch's Adam — the CPU fallback without TE/Apex —
fails on the `step` state, and 'fully_sharded_model_space' cannot be saved with torch_dist.)
"""

from __future__ import annotations

import zlib

import pytest
import torch

from dsv4flash.integrations.mcore.csa2.weights import global_name
from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity]

SEQ, MICROBATCHES, STEPS = 16, 2, 2
TARGETS = ["linear_q_down", "linear_kv", "linear_proj", "linear_o_group_proj"]




def _build(pipeline: bool):
    """Model (DDP-wrapped), optimizer and the inner model for this rank."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state
    from tests.mbridge import shim

    shim.install()
    from dsv4flash.integrations import mbridge

    ref = sup.reference(seed=0)
    overrides = dict(pipeline_dtype=torch.float32, variable_seq_lengths=True) if pipeline else {}
    model = DSV41ModelProvider(ref.cfg, recompute="full", overrides=overrides).provide()
    load_reference_state(model, ref.state_dict())
    model = mbridge.DSV41LoRA(target_modules=TARGETS, dim=4, alpha=8)(model, training=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".adapter." in name:
                gen = torch.Generator().manual_seed(zlib.crc32(global_name(name, model).encode()))
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=torch.float32), [ddp])
    return ddp, optimizer, model


def _batches(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, sup.VOCAB, (1, SEQ + 1), generator=gen)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _step(ddp, optimizer, step: int) -> list[float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=_batches(step), model=[ddp],
                                         num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=1,
                                         forward_only=False)
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    return [float(x["loss"]) for x in losses]


def _adapters(model) -> dict[str, torch.Tensor]:
    return {global_name(n, model): p.detach().clone() for n, p in model.named_parameters() if ".adapter." in n}


def _sharded(ddp, optimizer, is_loading: bool = False):
    """Model + optimizer sharded state: Adam moments are keyed like the parameters they belong to, so
    another model-parallel layout loads them."""
    model_sd = ddp.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def _resume_rank(rank: int, world_size: int, ckpt: str, expected_path: str) -> None:
    from megatron.core import dist_checkpointing

    from tests.mcore.test_engram_pinned import cuda_type_names

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    with cuda_type_names(), parallel.model_parallel(pp=world_size, rank=rank, world_size=world_size, seed=3):
        ddp, optimizer, model = _build(pipeline=True)
        state = dist_checkpointing.load(_sharded(ddp, optimizer, is_loading=True), ckpt)
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        losses = _step(ddp, optimizer, STEPS - 1)
        if rank == world_size - 1:
            assert losses == expected["losses"]
        got = _adapters(model)
        assert got
        for name, value in got.items():
            assert torch.equal(value, expected["adapters"][name]), f"stage {rank} {name}: differs after resume"


@pytest.mark.slow
@LAYOUT(pp=2, recompute="full", check="checkpoint at PP = 1 (adapter + Adam state, megatron-core "
        "dist_checkpointing), resumed at PP = 2: "
        "the next step's loss and adapters bit-identical to the uninterrupted run")
def test_adapter_checkpoint_resumes_bit_identically_at_another_layout(tmp_path):
    from megatron.core import dist_checkpointing

    from tests.mcore.test_engram_pinned import cuda_type_names

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with sup.single_thread(), cuda_type_names(), parallel.model_parallel(seed=3):
        ddp, optimizer, model = _build(pipeline=False)
        for step in range(STEPS - 1):
            _step(ddp, optimizer, step)
        dist_checkpointing.save(_sharded(ddp, optimizer), str(ckpt))
        losses = _step(ddp, optimizer, STEPS - 1)  # the uninterrupted run
        expected = {"losses": losses, "adapters": _adapters(model)}
    path = tmp_path / "expected.pt"
    torch.save(expected, path)
    with sup.single_thread():
        parallel.spawn_gloo(_resume_rank, 2, str(ckpt), str(path), timeout=600)
