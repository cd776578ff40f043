"""Pure-torch LoRA math of the serving paths that stock vLLM cannot express (no vLLM import here).

The engine integrations (`dsv4flash.integrations.vllm`) wrap these functions; the tests check them against
the single-device reference model (`dsv4flash.model`, `dsv4flash.lora`):

| module          | path                                                              |
|-----------------|-------------------------------------------------------------------|
| `multi_adapter` | per-token multi-adapter application (punica slot semantics), plain and grouped |
| `rope`          | inverse RoPE of the attention output in vLLM's `[T, H, head_dim]` layout |
| `o_proj`        | grouped output projection `wo_a`: BF16 / FP8 base + block-diagonal delta |
| `compressor`    | compressor `[wkv ‖ wgate]` projection with an fp32 output and its delta |

Single-adapter math (`lora_forward`, `grouped_lora_forward`, …) lives in `dsv4flash.lora.functional` and is
reused, never restated.
"""

from dsv4flash.lora.serving.compressor import compressor_kv_score, compressor_lora_delta
from dsv4flash.lora.serving.multi_adapter import (
    SlotStacks,
    grouped_factors,
    slot_grouped_lora_delta,
    slot_lora_delta,
    slice_groups,
)
from dsv4flash.lora.serving.o_proj import (
    grouped_o_proj_base,
    grouped_o_proj_fp8_base,
    o_proj_lora_delta,
    split_groups,
)
from dsv4flash.lora.serving.rope import cos_sin_cache, inverse_rope_heads

__all__ = [
    "SlotStacks", "grouped_factors", "slot_grouped_lora_delta", "slot_lora_delta", "slice_groups",
    "cos_sin_cache", "inverse_rope_heads",
    "grouped_o_proj_base", "grouped_o_proj_fp8_base", "o_proj_lora_delta", "split_groups",
    "compressor_kv_score", "compressor_lora_delta",
]
