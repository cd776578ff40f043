"""MXFP4 routed-expert refit under MoE LoRA: find the `Mxfp4MoEMethod` behind vLLM's LoRA wrapper.

Once vLLM wraps a MoE in `FusedMoEWithLoRA`, `RoutedExperts.quant_method` is a `FusedMoEModularMethod` holding
the original in `.old_quant_method` (docs/upstream.md §3.3). veRL's refit tests
`isinstance(module.quant_method, Mxfp4MoEMethod)` and reads the layout and backend from it, so under LoRA the
experts are either skipped (checkpoint-layout bytes then land in kernel-layout storage) or refused.
"""

from __future__ import annotations


def mxfp4_quant_method(module):
    """The `Mxfp4MoEMethod` serving `module` (unwrapping LoRA's modular wrappers), or None."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

    if not isinstance(module, RoutedExperts):
        return None
    method, seen = getattr(module, "quant_method", None), 0
    while method is not None and not isinstance(method, Mxfp4MoEMethod) and seen < 8:
        method, seen = getattr(method, "old_quant_method", None), seen + 1
    return method if isinstance(method, Mxfp4MoEMethod) else None
