"""Runtime twin of DSV41-VLLM-003: LoRA on the CSA2 compressor's projections is applied, in fp32.

Why: the compressor's `wkv`/`wgate` are fused into `compressor.fused_wkv_wgate` (a `MergedColumnParallelLinear`),
but `DeepseekV4Attention._run_parallel_input_projections` computes the score as a raw
`torch.mm(hidden_states, fused_wkv_wgate.weight.T, out_dtype=torch.float32)`. A LoRA-wrapped layer forwards
`.weight` to its base, so compressor adapters load without error and never change the compressed KV
(docs/upstream.md §3.2). The ratio-1 compressor (the CED source) has no gate, so the stock two-slice
merged-column LoRA layer does not fit it either.

How: put `CompressorProjectionWithLoRA` first in `vllm.lora.utils._all_lora_classes` for modules whose prefix
ends in `compressor.fused_wkv_wgate`; it takes the packed `[wkv, wgate]` adapter (rejecting a `wgate` LoRA on a
ratio-1 compressor) and computes the per-token multi-adapter delta in fp32. `_run_parallel_input_projections`
adds that delta to the fp32 `kv_score` it returns, before pooling and quantisation.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.vllm.patches import vllm_twin

TOUCHES = (
    "vllm.lora.utils._all_lora_classes",
    "vllm.models.deepseek_v41.attention.DeepseekV4Attention._run_parallel_input_projections",
)


def upstream_has_compressor_lora() -> bool:
    """Probe: does vLLM ship a LoRA layer for the compressor's fused projection?"""
    from vllm.lora import utils

    return any(getattr(cls, "compressor_projection", False) for cls in utils._all_lora_classes)


def make_input_projections(original):
    """`_run_parallel_input_projections` that adds the compressor LoRA delta to the fp32 `kv_score`."""
    from dsv4flash.integrations.vllm.lora_layers import CompressorProjectionWithLoRA

    def _run_parallel_input_projections(self, hidden_states):
        """Stock projections; a LoRA'd compressor gets `kv_score += Δ(hidden_states)` (fp32)."""
        qr_kv, kv_score, indexer_weights = original(self, hidden_states)
        compressor = self.compressor
        if kv_score is not None and compressor is not None and \
                isinstance(compressor.fused_wkv_wgate, CompressorProjectionWithLoRA):
            kv_score = kv_score + compressor.fused_wkv_wgate.lora_delta(hidden_states)
        return qr_kv, kv_score, indexer_weights

    return _run_parallel_input_projections


@vllm_twin(
    patch_id="DSV41-VLLM-003",
    touches=TOUCHES,
    gate="DSV4FLASH_VLLM_COMPRESSOR_LORA",
    tests=("tests/vllm/test_compressor_lora.py",),
    depends_on=("DSV41-VLLM-002",),
    upstream_has_it=upstream_has_compressor_lora,
)
def install(patcher: Patcher) -> None:
    """Prepend the compressor LoRA class and wrap the attention's input projections."""
    from vllm.lora import utils
    from vllm.models.deepseek_v41.attention import DeepseekV4Attention

    from dsv4flash.integrations.vllm.lora_layers import CompressorProjectionWithLoRA

    from dsv4flash.integrations.vllm.patches.grouped_wo_a import LoRAClassTable

    current = tuple(c for c in utils._all_lora_classes if c is not CompressorProjectionWithLoRA)
    patcher.replace(utils, "_all_lora_classes", LoRAClassTable((CompressorProjectionWithLoRA, *current)))
    original = DeepseekV4Attention.__dict__["_run_parallel_input_projections"]
    patcher.replace(DeepseekV4Attention, "_run_parallel_input_projections", make_input_projections(original))

