"""LoRA placement for the reference model: declarative targets, the study's presets, block-diagonal `wo_a`,
packed routed experts, adapter directories in the layouts PEFT / vLLM / Megatron load, and the early-stopped
backward. See docs/lora.md."""

from dsv4flash.lora.apply import AdapterInfo, LoraHandle, apply_lora, get_handle, plan_lora
from dsv4flash.lora.config import PRESETS, LoraConfig, PresetSpec
from dsv4flash.lora.early_stop import first_trainable_layer, forward_with_early_stop
from dsv4flash.lora.functional import (block_diagonal, grouped_from_shared_a, grouped_lora_delta, grouped_lora_forward,
                                       lora_delta, lora_forward, packed_expert_delta)
from dsv4flash.lora.optim import param_groups
from dsv4flash.lora.layouts import LAYOUTS, AdapterLayoutError, from_layout, to_layout
from dsv4flash.lora.peft_io import load_peft_adapter, read_adapter_config, save_peft_adapter
from dsv4flash.lora.state import (base_state_dict, canonical_key, check_lora_state_dict, load_lora_state_dict,
                                  lora_parameters, lora_state_dict, merged_state_dict, zero_lora)
from dsv4flash.lora.targets import GROUP_ALIASES, GROUPS, kv_write_modules, module_group, resolve_targets

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
