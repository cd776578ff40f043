"""Runtime twin of DSV41-VLLM-001: the DeepSeek-V4.1 vision model declares LoRA and keys vision adapters per image.

Why: vLLM 0.33 registers `DeepseekV41ForCausalLM` (the vision wrapper in `models/deepseek_v41/nvidia/vl_model.py`)
without `SupportsLoRA` or `get_mm_mapping`, so `LoRAConfig.verify_with_model_config` rejects `--enable-lora`
for every V4.1 checkpoint even though its language model supports LoRA (vLLM #57166). With tower/connector
LoRA the runner installs one mapping for all images of a step, but V4.1 encodes image by image, so every
image after the first runs with the first image's adapter: two requests with different adapters in one
batch mix their vision adapters.

How: register `dsv4flash.integrations.vllm.model:DeepseekV41ForCausalLMWithLoRA` (lazy string) under the
`DeepseekV41ForCausalLM` architecture. The subclass declares `SupportsLoRA` with the language-model and ViT
packed modules (`wqkv`, fused `w1`), `lora_skip_prefixes = ["mtp."]`, the language_model / aligner / vision
prefixes, per-image token counts, and narrows the tower and connector punica metadata to each image's own
adapter around its encode (the DP-sharded ViT path is bypassed while tower LoRA is on).
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.vllm.patches import vllm_twin

ARCH = "DeepseekV41ForCausalLM"
CLASS_PATH = "dsv4flash.integrations.vllm.model:DeepseekV41ForCausalLMWithLoRA"
TOUCHES = ("vllm.models.deepseek_v41.nvidia.vl_model.DeepseekV41ForCausalLM",)


def upstream_declares_lora() -> bool:
    """Probe: does the stock V4.1 vision class support LoRA with a multimodal mapping and per-image adapters?"""
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.models.deepseek_v41.nvidia.vl_model import DeepseekV41ForCausalLM

    return (supports_lora(DeepseekV41ForCausalLM) and hasattr(DeepseekV41ForCausalLM, "get_mm_mapping")
            and getattr(DeepseekV41ForCausalLM, "per_image_lora_scope", False))


class _Models(dict):
    """The registry's arch -> model table (a dict subclass so the patch marker can be attached)."""


@vllm_twin(
    patch_id="DSV41-VLLM-001",
    touches=TOUCHES,
    gate="DSV4FLASH_VLLM_LORA_MODEL",
    tests=("tests/vllm/test_model_class.py",),
    upstream_has_it=upstream_declares_lora,
)
def install(patcher: Patcher) -> None:
    """Point the V4.1 architecture at the LoRA-capable subclass (a copied table, so revert restores the old one)."""
    from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel

    table = _Models(ModelRegistry.models)
    table[ARCH] = _LazyRegisteredModel(*CLASS_PATH.split(":"))
    patcher.replace(ModelRegistry, "models", table)
