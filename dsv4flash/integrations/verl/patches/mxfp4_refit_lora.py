"""Runtime twin of DSV41-VERL-002: the MXFP4 MoE refit finds the `Mxfp4MoEMethod` behind vLLM's LoRA wrapper.

Why: with MoE LoRA, vLLM replaces `RoutedExperts.quant_method` with a `FusedMoEModularMethod` that keeps the
original in `.old_quant_method` (docs/upstream.md §3.3). veRL's refit (`verl/utils/vllm/vllm_fp4_utils.py`) detects
routed experts with `isinstance(module.quant_method, Mxfp4MoEMethod)` and reads the checkpoint layout and the
backend from it, so under LoRA the experts are not staged and the refit stream writes checkpoint-layout bytes into
kernel-layout storage, silently corrupting the rollout's experts.

How: detection, layout and backend come from the unwrapped method
(`dsv4flash.integrations.verl.mxfp4.mxfp4_quant_method`); post-processing still goes through the module's own
quant method, whose LoRA wrapper delegates to the MXFP4 method and keeps its LoRA kernel context.
"""

from __future__ import annotations

import types

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = (
    "verl.utils.vllm.vllm_fp4_utils._is_mxfp4_fused_moe_module",
    "verl.utils.vllm.vllm_fp4_utils._mxfp4_checkpoint_layout",
    "verl.utils.vllm.vllm_fp4_utils.stage_mxfp4_moe_params_for_loading",
)


def upstream_unwraps_lora() -> bool:
    """Probe: does veRL recognise MXFP4 experts whose quant method LoRA has wrapped?"""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_modular_method import FusedMoEModularMethod
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
    from verl.utils.vllm import vllm_fp4_utils as fp4

    module = RoutedExperts.__new__(RoutedExperts)
    module.__dict__["quant_method"] = wrapper = FusedMoEModularMethod.__new__(FusedMoEModularMethod)
    wrapper.__dict__["old_quant_method"] = Mxfp4MoEMethod.__new__(Mxfp4MoEMethod)
    return bool(fp4._is_mxfp4_fused_moe_module(module))


def _stage(fp4, mxfp4_quant_method):
    """`stage_mxfp4_moe_params_for_loading` reading the backend from the unwrapped method."""

    def stage_mxfp4_moe_params_for_loading(model):
        """Stage checkpoint-layout buffers for every MXFP4 expert module, LoRA-wrapped or not."""
        supported = fp4._refittable_mxfp4_backends()
        staged, backends = [], set()
        for module in model.modules():
            method = mxfp4_quant_method(module)
            if method is None:
                continue
            backend = getattr(method, "mxfp4_backend", None)
            if backend not in supported:
                raise NotImplementedError(
                    f"mxfp4 MoE refit does not support the {backend} backend selected by {type(module).__name__}. "
                    f"Supported backends: {', '.join(str(b) for b in supported)}.")
            fp4._stage_mxfp4_moe_params(module)
            staged.append(module)
            backends.add(backend)
        fp4.logger.info("Staged %d mxfp4 MoE modules for in-place refit (backends: %s)", len(staged),
                        ", ".join(sorted(str(b) for b in backends)) or "none")
        return staged

    return stage_mxfp4_moe_params_for_loading


@verl_twin(
    patch_id="DSV41-VERL-002",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_MXFP4_REFIT_LORA",
    tests=("tests/verl/test_mxfp4_refit.py",),
    upstream_has_it=upstream_unwraps_lora,
)
def install(patcher: Patcher) -> None:
    """Route detection, layout and backend through the unwrapped MXFP4 method."""
    from verl.utils.vllm import vllm_fp4_utils as fp4

    from dsv4flash.integrations.verl.mxfp4 import mxfp4_quant_method

    layout = fp4._mxfp4_checkpoint_layout

    def _is_mxfp4_fused_moe_module(module) -> bool:
        """MXFP4 routed experts, also when LoRA wrapped their quant method."""
        return mxfp4_quant_method(module) is not None

    def _mxfp4_checkpoint_layout(module):
        """veRL's layout table, computed from the unwrapped MXFP4 method."""
        return layout(types.SimpleNamespace(quant_method=mxfp4_quant_method(module)))

    patcher.replace(fp4, "_is_mxfp4_fused_moe_module", _is_mxfp4_fused_moe_module)
    patcher.replace(fp4, "_mxfp4_checkpoint_layout", _mxfp4_checkpoint_layout)
    stage = _stage(fp4, mxfp4_quant_method)
    patcher.replace(fp4, "stage_mxfp4_moe_params_for_loading", stage)
    # the quantized-refit entry point imported the function by name
    from verl.utils.vllm import vllm_quant_utils

    patcher.replace(vllm_quant_utils, "stage_mxfp4_moe_params_for_loading", stage)
