"""GPU-only paths of the CSA2 spec builder: Transformer Engine norm/linears, grouped-GEMM experts, fused router.

Run on a CUDA machine with Transformer Engine (≥ 2.13 for the fused sqrtsoftplus router). The oracle is
the reference model on the same GPU in fp32 with TF32 off; TE kernels reorder fp32 sums, so logits are
compared to 1e-4 and gradients to 1e-3 of each tensor's largest entry.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore.single_gpu import single_gpu_megatron
from tests.mcore.test_csa2_offload import offload_run, state_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.upstream]


@pytest.fixture(scope="module")
def gpu():
    """A single-GPU Megatron session for the module (Transformer Engine backend)."""
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed")
    with single_gpu_megatron():
        yield


def _te_model(ref, **kwargs):
    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

    model = DSV41ModelProvider(ref.cfg, backend="transformer_engine", **kwargs).provide().cuda()
    load_reference_state(model, {k: v.cuda() for k, v in ref.state_dict().items()})
    return model.train()


@pytest.mark.parametrize("grouped, fused", [(False, False), (True, False), (True, True)])
def test_transformer_engine_backend_matches_reference(gpu, grouped, fused):
    ref = sup.reference(seed=0).cuda()
    ids = sup.token_ids(2, 64, seed=61).cuda()
    weights = sup.probe((2, 64, sup.VOCAB), seed=62).cuda()
    logits = ref(ids)
    (logits * weights).sum().backward()
    model = _te_model(ref, moe_grouped_gemm=grouped, fused_router=fused)
    layer = model.decoder.layers[2]
    assert type(layer.input_layernorm).__module__.startswith("transformer_engine")  # TENorm
    assert type(layer.self_attention.linear_q_up).__name__ == "TEColumnParallelLinear"
    if grouped:
        assert type(layer.mlp.experts).__name__ == "TEGroupedMLP"
    assert model.config.moe_router_fusion is fused
    out = model(ids)
    torch.testing.assert_close(out, logits.detach(), rtol=0, atol=1e-4)
    (out * weights).sum().backward()
    sup.assert_grads_match(ref, model, rel=1e-3)


def test_transformer_engine_full_recompute_matches_no_recompute(gpu):
    ref = sup.reference(seed=0).cuda()
    ids = sup.token_ids(1, 48, seed=63).cuda()
    weights = sup.probe((1, 48, sup.VOCAB), seed=64).cuda()
    runs = []
    for recompute in ("none", "full"):
        model = _te_model(ref, moe_grouped_gemm=True, recompute=recompute)
        (model(ids) * weights).sum().backward()
        runs.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert runs[0].keys() == runs[1].keys()
    for name, grad in runs[0].items():
        torch.testing.assert_close(runs[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@LAYOUT(recompute="full", offload=True, status="gpu", check="bf16, distributed Adam with master weights "
        "and moments on the host (HybridDeviceOptimizer, fraction 1) vs on the device: same adapters after 3 steps")
def test_full_recompute_with_optimizer_cpu_offload_matches_device_optimizer(gpu):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from tests.mbridge import shim

    shim.install()
    ref = sup.reference(seed=0).cuda()
    _, on_device, _ = offload_run(ref, offload=False, device="cuda")
    _, offloaded, optimizer = offload_run(ref, offload=True, device="cuda")
    hybrid = optimizer.optimizer
    assert isinstance(hybrid, HybridDeviceOptimizer) and hybrid.cpu_optimizers and hybrid.gpu_optimizer is None
    host_state = [t for opt in hybrid.cpu_optimizers for s in opt.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.numel() > 1]
    assert host_state and all(t.device.type == "cpu" for t in host_state)  # moments and master weights
    assert state_bytes(optimizer)["device"] == 0
    assert on_device.keys() == offloaded.keys()
    for name, want in on_device.items():  # host AdamW vs device (fused) Adam: same fp32 math, bf16 params
        torch.testing.assert_close(offloaded[name], want, rtol=1e-2, atol=1e-3, msg=name)
