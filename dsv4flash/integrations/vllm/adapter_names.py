"""What vLLM 0.33's LoRA loader expects of a DeepSeek-V4.1 adapter: module names, packing, expert mapping.

`WorkerLoRAManager._load_adapter` checks every adapter tensor against `expected_lora_modules`: the model's
LoRA-capable leaf modules (`get_supported_lora_modules`, i.e. every `LinearBase` / `MoERunner` suffix),
packed modules replaced by their parts (`packed_modules_mapping`), and the routed experts by the expert
mapping's per-expert names (`experts.{e}.w1` …). Building the V4.1 model needs CUDA, so the suffixes are
listed here from vLLM's model sources (`deepseek_v41/nvidia/model.py`, `attention.py`, `compressor.py`,
`common/engram.py`, `deepseek_v4/common/vision.py`; tests/vllm checks each against the installed source);
the packing and the expert mapping come from the model class and vLLM's `RoutedExperts` themselves.

`load_lora_model(directory, num_experts)` runs vLLM's own `PEFTHelper` + `LoRAModel.from_local_checkpoint`
on CPU with these names and the V4.1 vision model's rename mapper — what the worker does, without an engine.
Importing this module does not import vLLM.
"""

from __future__ import annotations

import os

# LinearBase / MoERunner leaf names of vLLM's V4.1 vision model (language model, compressor, indexer, Engram,
# ViT, aligner): `get_supported_lora_modules(model)` of the built model.
SUPPORTED_LORA_MODULES = (
    "fused_wqa_wkv", "wq_b", "wo_a", "wo_b",  # attention
    "fused_wkv_wgate",  # compressor
    "wk", "weights_proj",  # indexer (its wq_b shares the name)
    "gate", "gate_up_proj", "down_proj", "experts",  # router, shared experts, routed experts
    "wkv",  # Engram
    "proj", "wqkv", "wo", "w1", "w2",  # ViT patch embedding, attention, MLP; aligner
    "lm_head",
)


def packed_modules_mapping(num_experts: int) -> dict[str, list[str]]:
    """The model class's packed modules plus vLLM's 2-D per-expert names for `experts` (as the manager builds)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from dsv4flash.integrations.vllm.model import DeepseekV41ForCausalLMWithLoRA

    mapping = {k: list(v) for k, v in DeepseekV41ForCausalLMWithLoRA.packed_modules_mapping.items()}
    mapping["experts"] = [weight.rstrip(".") for _, weight, _, _ in
                          RoutedExperts.build_expert_params_mapping("w1", "w2", "w3", num_experts)]
    return mapping


def expected_lora_modules(num_experts: int) -> set[str]:
    """`expected_lora_modules` exactly as `WorkerLoRAManager._load_adapter` computes it for V4.1."""
    packed = packed_modules_mapping(num_experts)
    expected: list[str] = []
    for module in SUPPORTED_LORA_MODULES:
        expected.extend(packed.get(module, [module]))
        if module == "experts":
            expected.append(module)
    return set(expected)


def rename_mapper():
    """The V4.1 vision model's checkpoint -> vLLM name mapper, reduced to renames as the worker uses it."""
    from vllm.models.deepseek_v41.nvidia.vl_model import _make_deepseek_v4_vl_weights_mapper

    return _make_deepseek_v4_vl_weights_mapper("fp4", "weight_scale_inv").get_rename_mapper()


def load_lora_model(directory: str | os.PathLike, num_experts: int, *, max_lora_rank: int, dtype=None):
    """vLLM's own adapter load for V4.1 on CPU: `PEFTHelper` validation + `LoRAModel.from_local_checkpoint`."""
    import torch
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from dsv4flash.integrations.vllm.model import DeepseekV41ForCausalLMWithLoRA

    helper = PEFTHelper.from_local_dir(str(directory), max_position_embeddings=None)
    helper.validate_legal(LoRAConfig(max_lora_rank=max_lora_rank, lora_dtype=dtype or torch.float32))
    return LoRAModel.from_local_checkpoint(
        str(directory), expected_lora_modules(num_experts), helper, lora_model_id=1, device="cpu",
        dtype=dtype or torch.float32, weights_mapper=rename_mapper(),
        skip_prefixes=DeepseekV41ForCausalLMWithLoRA.lora_skip_prefixes)
