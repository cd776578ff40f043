"""Optimizer CPU offload with uniform full recompute, in the product's CPU development mode (2 gloo DP ranks).

The study's setting: bf16 model, a Megatron-Bridge LoRA, uniform full recompute (1 layer per chunk) and
megatron-core's distributed optimizer with `optimizer_cpu_offload=True`, `optimizer_offload_fraction=1`
(`HybridDeviceOptimizer`: fp32 master weights and Adam moments on the host, host AdamW, results copied back
to the device parameters), overlapped D2H/H2D copies on. `dsv4flash.cpu_mode.mcore_redirect` gives the offload
real, separate host copies of the "device" parameters on a CPU-only machine. The offloaded run must equal
the same run with the optimizer on the device — losses and every adapter value bit-identical after 3 steps —
and its optimizer state must sit in the host copies only: 12 bytes per local adapter element (fp32 master,
exp_avg, exp_avg_sq) on the host and none on the device, where the on-device run holds those 12 bytes.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from dsv4flash.integrations.mcore.csa2.weights import global_name
from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]

# The window-KV `linear_kv` only: the ratio > 1 compressor's `linear_kv` is an fp32 island, and megatron-core
# 0.19's distributed optimizer hands fp32 parameters to HybridDeviceOptimizer as non-leaf views of the
# parameter ("can't optimize a non-leaf Tensor", on a GPU too); docs/megatron.md §7.
OFFLOAD_TARGETS = ["linear_q_down", "*.self_attention.linear_kv", "linear_proj", "linear_o_group_proj"]
STEPS, SEQ = 3, 32


def offload_run(ref, offload: bool, device: str = "cpu", steps: int = STEPS) -> tuple[list[float], dict, object]:
    """bf16 model + LoRA, uniform full recompute, megatron-core DDP + distributed Adam (optionally offloaded).

    Returns the per-step losses, the adapters (fp32 copies, by global name) and the megatron-core optimizer.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from dsv4flash.integrations import mbridge
    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

    model = DSV41ModelProvider(ref.cfg, recompute="full", overrides=dict(
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)).provide().to(device)
    load_reference_state(model, {k: v.to(device) for k, v in ref.state_dict().items()})
    model = mbridge.DSV41LoRA(target_modules=OFFLOAD_TARGETS, dim=4, alpha=8)(model, training=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".adapter." in name:
                gen = torch.Generator().manual_seed(zlib.crc32(global_name(name, model).encode()))
                param.copy_(torch.randn(param.shape, generator=gen).to(param.device) * 0.05)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), Float16Module(model.config, model))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
        optimizer_cpu_offload=offload, optimizer_offload_fraction=1.0 if offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=offload, use_precision_aware_optimizer=offload), [ddp])
    losses = []
    for step in range(steps):
        ids = sup.token_ids(1, SEQ, seed=70 + step).to(device)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(ids, labels=ids).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok, f"step {step}: the optimizer skipped the update"
        losses.append(float(loss))
    adapters = {global_name(n, model): p.detach().float().cpu() for n, p in model.named_parameters()
                if ".adapter." in n}
    assert adapters and all(".adapter." in n for n, p in model.named_parameters() if p.requires_grad), \
        "only adapter parameters may train"
    return losses, adapters, optimizer


def state_bytes(optimizer) -> dict[str, int]:
    """Optimizer state bytes of this rank: on the host copies (offload) and on the device parameters."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    (distributed,) = optimizer.chained_optimizers  # one parameter group family: the bf16 adapters
    inner = distributed.optimizer

    def tensor_bytes(tensors) -> int:  # distinct tensors only: HDO's state also names each master as "master_param"
        distinct = {t.data_ptr(): t for t in tensors if torch.is_tensor(t) and t.numel() > 1}
        return sum(t.numel() * t.element_size() for t in distinct.values())

    if isinstance(inner, HybridDeviceOptimizer):
        host = [t for opt in inner.cpu_optimizers for p, s in opt.state.items() for t in (p, *s.values())]
        device = [t for s in inner.gpu_optimizer.state.values() for t in s.values()] if inner.gpu_optimizer else []
        return {"host": tensor_bytes(host), "device": tensor_bytes(device)}
    mains = [p for group in distributed.shard_fp32_from_float16_groups for p in group if p is not None]
    return {"host": 0, "device": tensor_bytes(mains + [t for s in inner.state.values() for t in s.values()])}


def _offload_rank(rank: int, world_size: int) -> None:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from tests.mbridge import shim
    from tests.mcore.test_engram_pinned import cuda_type_names

    torch.set_num_threads(1)
    shim.install()
    ref = sup.reference(seed=0)
    with cuda_type_names(), parallel.model_parallel(rank=rank, world_size=world_size, seed=3):
        on_device_losses, on_device, device_opt = offload_run(ref, offload=False)
        losses, offloaded, offload_opt = offload_run(ref, offload=True)
        hybrid = offload_opt.optimizer
        assert isinstance(hybrid, HybridDeviceOptimizer) and hybrid.cpu_optimizers and hybrid.gpu_optimizer is None
        # The host copies are separate tensors from the parameters they update.
        for host, param in hybrid.cpu_copys_map_gpu_param.items():
            assert host.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
        local = sum(p.numel() for group in hybrid.param_groups for p in group["params"])  # this rank's shard
        assert 0 < local < sum(t.numel() for t in offloaded.values()), "the distributed optimizer did not shard"
        assert state_bytes(offload_opt) == {"host": 12 * local, "device": 0}
        assert state_bytes(device_opt) == {"host": 0, "device": 12 * local}
        assert losses == on_device_losses
        assert offloaded.keys() == on_device.keys()
        for name, want in on_device.items():
            assert torch.equal(offloaded[name], want), f"rank {rank} {name}: offloaded Adam differs"


@pytest.mark.slow
@LAYOUT(recompute="full", offload=True, check="2 DP ranks, bf16, uniform full recompute, distributed Adam with "
        "master weights and moments on the host (HybridDeviceOptimizer, fraction 1, overlapped copies) vs on the "
        "device: losses and adapters bit-identical after 3 steps; 12 B per local adapter element on the host, 0 on "
        "the device")
def test_full_recompute_with_optimizer_cpu_offload_equals_device_optimizer():
    with sup.single_thread():
        parallel.spawn_gloo(_offload_rank, 2, timeout=600)
