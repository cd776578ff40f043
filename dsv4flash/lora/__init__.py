"""LoRA placement for the reference model: declarative targets, the study's presets, block-diagonal `wo_a`,
packed routed experts, adapter directories in the layouts PEFT / vLLM / Megatron load, and the early-stopped
backward. See docs/lora.md.

Names are imported when first used: `dsv4flash.lora.config` (the recipe's placement check) loads without torch.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "AdapterInfo": "dsv4flash.lora.apply",
    "LoraHandle": "dsv4flash.lora.apply",
    "apply_lora": "dsv4flash.lora.apply",
    "get_handle": "dsv4flash.lora.apply",
    "plan_lora": "dsv4flash.lora.apply",
    "PRESETS": "dsv4flash.lora.config",
    "LoraConfig": "dsv4flash.lora.config",
    "PresetSpec": "dsv4flash.lora.config",
    "first_trainable_layer": "dsv4flash.lora.early_stop",
    "forward_with_early_stop": "dsv4flash.lora.early_stop",
    "block_diagonal": "dsv4flash.lora.functional",
    "grouped_from_shared_a": "dsv4flash.lora.functional",
    "grouped_lora_delta": "dsv4flash.lora.functional",
    "grouped_lora_forward": "dsv4flash.lora.functional",
    "lora_delta": "dsv4flash.lora.functional",
    "lora_forward": "dsv4flash.lora.functional",
    "packed_expert_delta": "dsv4flash.lora.functional",
    "param_groups": "dsv4flash.lora.optim",
    "LAYOUTS": "dsv4flash.lora.layouts",
    "AdapterLayoutError": "dsv4flash.lora.layouts",
    "from_layout": "dsv4flash.lora.layouts",
    "to_layout": "dsv4flash.lora.layouts",
    "load_peft_adapter": "dsv4flash.lora.peft_io",
    "read_adapter_config": "dsv4flash.lora.peft_io",
    "save_peft_adapter": "dsv4flash.lora.peft_io",
    "base_state_dict": "dsv4flash.lora.state",
    "canonical_key": "dsv4flash.lora.state",
    "check_lora_state_dict": "dsv4flash.lora.state",
    "load_lora_state_dict": "dsv4flash.lora.state",
    "lora_parameters": "dsv4flash.lora.state",
    "lora_state_dict": "dsv4flash.lora.state",
    "merged_state_dict": "dsv4flash.lora.state",
    "zero_lora": "dsv4flash.lora.state",
    "GROUP_ALIASES": "dsv4flash.lora.targets",
    "GROUPS": "dsv4flash.lora.targets",
    "kv_write_modules": "dsv4flash.lora.targets",
    "module_group": "dsv4flash.lora.targets",
    "resolve_targets": "dsv4flash.lora.targets",
}

__all__ = [
    "AdapterInfo", "LoraHandle", "apply_lora", "get_handle", "plan_lora",
    "PRESETS", "LoraConfig", "PresetSpec",
    "first_trainable_layer", "forward_with_early_stop",
    "block_diagonal", "grouped_from_shared_a", "grouped_lora_delta", "grouped_lora_forward", "lora_delta",
    "lora_forward", "packed_expert_delta",
    "param_groups",
    "LAYOUTS", "AdapterLayoutError", "from_layout", "to_layout",
    "load_peft_adapter", "read_adapter_config", "save_peft_adapter",
    "base_state_dict", "merged_state_dict", "canonical_key", "check_lora_state_dict", "load_lora_state_dict", "lora_parameters", "lora_state_dict", "zero_lora",
    "GROUP_ALIASES", "GROUPS", "kv_write_modules", "module_group", "resolve_targets",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'dsv4flash.lora' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
