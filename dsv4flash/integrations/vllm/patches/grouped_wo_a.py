"""Runtime twin of DSV41-VLLM-002: LoRA on the grouped output projection `wo_a` is block-diagonal and applied.

Why: V4.1's `wo_a` is a `ColumnParallelLinear` tagged `is_bmm`, run group by group inside the o-projection
(`dsv41_o_proj` -> `deep_gemm_fp8_o_proj`, the fused SM100 WO-A kernel, the mega-attention `_o_proj`), which read
`layer.wo_a.weight` directly. vLLM wraps it in a stock `ColumnParallelLinearWithLoRA` whose forward is never called,
so a `wo_a` adapter loads without error and changes nothing (docs/upstream.md §3.2); the stock wrapper would also
apply a dense (cross-group) delta. The mega-attention backend, the SM100 default, also permutes `wq_b` rows and
`wo_a` columns in place, so stock LoRA deltas land on the wrong rows there (docs/upstream.md §3.2).

How: put `GroupedOutputProjectionWithLoRA` first in `vllm.lora.utils._all_lora_classes`; it stores per-group
stacks (per-group or shared-A adapters, TP-sliced by group) and computes the block-diagonal delta of the
un-rotated, unquantised attention output (`dsv4flash.lora.serving`). `dsv41_o_proj` adds that delta to `z`
before `wo_b` (through its `wo_b_proj` hook) and skips the fused small-batch WO-A kernel, whose FP8 `z` cannot
take an addend. With LoRA enabled the mega-attention backend reports itself unavailable (default selection
falls back to FlashMLA) and refuses an explicit selection.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.vllm.patches import vllm_twin

TOUCHES = (
    "vllm.lora.utils._all_lora_classes",
    "vllm.models.deepseek_v41.nvidia.ops.o_proj.dsv41_o_proj",
    "vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn.DeepseekV4MegaAttnAttention",
)
# Modules that imported `dsv41_o_proj` by name and so hold their own reference to it.
O_PROJ_MODULES = (
    "vllm.models.deepseek_v41.nvidia.ops.o_proj",
    "vllm.models.deepseek_v41.nvidia.flashmla",
    "vllm.models.deepseek_v41.nvidia.flashinfer_sparse",
)


class LoRAClassTable(tuple):
    """`_all_lora_classes` with our classes first (a tuple subclass so the patch marker can be attached)."""


def upstream_has_grouped_wo_a_lora() -> bool:
    """Probe: does vLLM ship a LoRA layer for `is_bmm` projections ahead of the stock column-parallel one?"""
    from vllm.lora import utils

    for cls in utils._all_lora_classes:
        if getattr(cls, "grouped_output_projection", False):
            return True
    return False


def make_o_proj(original):
    """`dsv41_o_proj` that adds a LoRA'd `wo_a`'s block-diagonal delta to `z` before `wo_b`."""
    from dsv4flash.integrations.vllm.lora_layers import GroupedOutputProjectionWithLoRA

    def dsv41_o_proj(layer, attn_out, positions, wo_b_proj=None):
        """Stock o-projection; with a LoRA'd `wo_a`, `z += Δ(o)` before `wo_b` and no fused FP8 WO-A."""
        wo_a = layer.wo_a
        if not isinstance(wo_a, GroupedOutputProjectionWithLoRA):
            return original(layer, attn_out, positions, wo_b_proj)
        layer._fused_wo_a_token_limit = 0  # the fused kernel hands wo_b an FP8 z: no room for the delta
        delta = wo_a.lora_delta(attn_out, positions, layer.rotary_emb.cos_sin_cache, layer.n_local_heads)
        project = wo_b_proj or layer._wo_b_proj
        return original(layer, attn_out, positions, lambda z: project(z + delta.to(z.dtype)))

    return dsv41_o_proj


def _mega_attn_methods(cls):
    """`is_available_for` / `__init__` for the mega-attention backend that keep it away from LoRA."""
    is_available = cls.__dict__["is_available_for"].__func__
    init = cls.__dict__["__init__"]

    def is_available_for(klass, vllm_config) -> bool:
        """Unavailable with LoRA: it permutes wq_b rows / wo_a columns that LoRA deltas index."""
        return vllm_config.lora_config is None and is_available(klass, vllm_config)

    def __init__(self, vllm_config, *args, **kwargs):
        if vllm_config.lora_config is not None:
            raise ValueError("the FLASHMLA_MEGA_ATTN_DSV41 attention backend permutes wq_b rows and wo_a columns "
                             "in place, which LoRA deltas do not follow; select FLASHMLA_SPARSE_DSV41 (or "
                             "FLASHINFER_MLA_SPARSE_DSV41) when LoRA is enabled")
        init(self, vllm_config, *args, **kwargs)

    return classmethod(is_available_for), __init__


@vllm_twin(
    patch_id="DSV41-VLLM-002",
    touches=TOUCHES,
    gate="DSV4FLASH_VLLM_WO_A_LORA",
    tests=("tests/vllm/test_grouped_wo_a.py",),
    upstream_has_it=upstream_has_grouped_wo_a_lora,
)
def install(patcher: Patcher) -> None:
    """Prepend the LoRA class, rebind every `dsv41_o_proj` reference, fence off the mega-attention backend."""
    import importlib

    from vllm.lora import utils
    from vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn import DeepseekV4MegaAttnAttention

    from dsv4flash.integrations.vllm.lora_layers import GroupedOutputProjectionWithLoRA

    stock = tuple(c for c in utils._all_lora_classes if c is not GroupedOutputProjectionWithLoRA)
    patcher.replace(utils, "_all_lora_classes", LoRAClassTable((GroupedOutputProjectionWithLoRA, *stock)))
    original = importlib.import_module(O_PROJ_MODULES[0]).dsv41_o_proj
    replacement = make_o_proj(original)
    for name in O_PROJ_MODULES:
        module = importlib.import_module(name)
        if module.dsv41_o_proj is not original:
            raise RuntimeError(f"{name}.dsv41_o_proj is not vLLM 0.33's function; another patch replaced it")
        patcher.replace(module, "dsv41_o_proj", replacement)
    is_available_for, init = _mega_attn_methods(DeepseekV4MegaAttnAttention)
    patcher.replace(DeepseekV4MegaAttnAttention, "is_available_for", is_available_for)
    patcher.replace(DeepseekV4MegaAttnAttention, "__init__", init)
