"""DSV41-VERL-002: MXFP4 routed-expert refit with vLLM's MoE LoRA wrapper in place (real veRL + vLLM classes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-002"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
E, I, H = 4, 32, 64


def _to_kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """Stand-in for a backend's weight conversion: same bytes count, different bytes (nibble swap)."""
    return ((t << 4) | (t >> 4)).to(torch.uint8)


def _experts(wrapped: bool):
    """A RoutedExperts with MXFP4 parameters in kernel layout; optionally behind LoRA's FusedMoEModularMethod."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_modular_method import FusedMoEModularMethod
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization import mxfp4 as vllm_mxfp4

    module = RoutedExperts.__new__(RoutedExperts)
    nn.Module.__init__(module)
    gen = torch.Generator().manual_seed(0)
    shapes = {"w13_weight": (E, 2 * I, H // 2), "w2_weight": (E, H, I // 2),
              "w13_weight_scale": (E, 2 * I, H // 32), "w2_weight_scale": (E, H, I // 32)}
    for name, shape in shapes.items():
        data = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
        module.register_parameter(name, nn.Parameter(data, requires_grad=False))
    method = vllm_mxfp4.Mxfp4MoEMethod.__new__(vllm_mxfp4.Mxfp4MoEMethod)
    method.__dict__.update(num_experts=E, intermediate_size=I, hidden_size=H, mxfp4_backend=Mxfp4MoeBackend.MARLIN,
                           moe_kernel=None)

    def process_weights_after_loading(layer):
        for name in shapes:  # the backend rewrites every parameter through replace_parameter
            vllm_mxfp4.replace_parameter(layer, name, _to_kernel_layout(getattr(layer, name).data))

    method.process_weights_after_loading = process_weights_after_loading
    quant = method
    if wrapped:
        quant = FusedMoEModularMethod.__new__(FusedMoEModularMethod)
        quant.__dict__.update(old_quant_method=method, moe_kernel=None)
    module.__dict__["quant_method"] = quant
    model = nn.Module()
    model.experts = module
    return model, module


def _refit(model, module, checkpoint):
    """veRL's refit: stage, load checkpoint-layout bytes, replay the backend conversion into live storage."""
    from verl.utils.vllm import vllm_fp4_utils as fp4

    staged = fp4.stage_mxfp4_moe_params_for_loading(model)
    for name, data in checkpoint.items():
        getattr(module, name).data.copy_(data)  # what load_weights does through the staged params
    fp4.process_mxfp4_moe_weights_after_loading(staged)
    return staged


def _checkpoint(module, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randint(0, 256, p.shape, generator=gen, dtype=torch.int32).to(torch.uint8)
            for n, p in module.named_parameters()}


def test_refit_under_moe_lora_converts_in_place(patch_form):
    """With LoRA's wrapper, the experts are found, staged, reloaded and re-converted into the live storage."""
    from verl.utils.vllm import vllm_fp4_utils as fp4

    model, module = _experts(wrapped=True)
    assert fp4._is_mxfp4_fused_moe_module(module)
    layout = fp4._mxfp4_checkpoint_layout(module)
    live = {n: (p, p.data_ptr()) for n, p in module.named_parameters()}
    checkpoint = _checkpoint(module)
    staged = _refit(model, module, checkpoint)
    assert staged == [module]
    for name, (param, ptr) in live.items():
        assert getattr(module, name) is param and param.data_ptr() == ptr  # CUDA-graph addresses kept
        torch.testing.assert_close(param.data, _to_kernel_layout(checkpoint[name]), rtol=0, atol=0)
    patch_form.record("layout", {k: list(v[0]) for k, v in layout.items()})
    patch_form.record("w2_scale", module.w2_weight_scale.data.flatten()[:16])


def test_unwrapped_experts_still_refit(patch_form):
    from verl.utils.vllm import vllm_fp4_utils as fp4

    model, module = _experts(wrapped=False)
    assert fp4._is_mxfp4_fused_moe_module(module)
    checkpoint = _checkpoint(module, seed=2)
    assert _refit(model, module, checkpoint) == [module]
    torch.testing.assert_close(module.w13_weight.data, _to_kernel_layout(checkpoint["w13_weight"]), rtol=0, atol=0)
    patch_form.record("ok", True)


def test_stock_verl_skips_lora_wrapped_experts():
    """docs/upstream.md §3.3 on the real code: LoRA-wrapped experts go unrecognised, the reload is never converted."""
    from verl.utils.vllm import vllm_fp4_utils as fp4

    model, module = _experts(wrapped=True)
    with stock(PATCH_ID):
        assert not fp4._is_mxfp4_fused_moe_module(module)
        checkpoint = _checkpoint(module)
        assert _refit(model, module, checkpoint) == []
    # checkpoint-layout bytes now sit where the kernel expects its own layout
    torch.testing.assert_close(module.w13_weight.data, checkpoint["w13_weight"], rtol=0, atol=0)
