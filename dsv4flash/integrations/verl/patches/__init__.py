"""Runtime twins for veRL 0.9.1, one module per upstream change (Patch-Id `DSV41-VERL-NNN`).

| Patch-Id       | module                | change                                                        |
|----------------|-----------------------|---------------------------------------------------------------|
| DSV41-VERL-001 | `tensor_lora_loader`  | in-memory adapter loader for vLLM 0.33, chained after veRL's hijack |
| DSV41-VERL-002 | `mxfp4_refit_lora`    | MXFP4 MoE refit unwraps LoRA's modular quant method            |
| DSV41-VERL-003 | `base_layer_naming`   | unmerged sync probes the loader's `.base_layer.` naming         |
| DSV41-VERL-004 | `r3_text_only`        | text-only R3 routing replay (row map + native image rows)      |
| DSV41-VERL-005 | `encoder_cache_reset` | adapter syncs reset vLLM's encoder cache                       |
| DSV41-VERL-006 | `gloo_backend_string` | `cpu:gloo` alone as the default backend on a CPU platform      |
| DSV41-VERL-007 | `ray_resource_check`  | the Ray resource check counts the platform's resource          |
| DSV41-VERL-008 | `rollout_register`    | `register_rollout`: a public register function for rollouts    |
| DSV41-VERL-009 | `provider_peft`       | the Megatron engine takes a provider's own PEFT (`provide_peft`) |
| DSV41-VERL-010 | `fp32_engine`         | the Megatron engine accepts `dtype=float32`                    |
| DSV41-VERL-011 | `processor_1d_rope`   | `hf_processor` keeps the processor of a 1-D RoPE multimodal model |
| DSV41-VERL-012 | `mm_model_kwargs`     | Megatron forwards pass every multimodal input the model declares |
| DSV41-VERL-013 | `r3_rollout_rows`     | the agent loop maps recorded routes onto training rows (processor) |
| DSV41-VERL-014 | `token_aligned_inputs` | token-aligned multimodal inputs from the trajectory's token ids |

The upstream form of each lives in `patches/verl/` under the same Patch-Id. Importing these modules never
imports veRL; `install()` does.
"""

import functools

from dsv4flash.patching.twins import runtime_patch


# What every veRL 0.9.1 twin shares: target, version window, upstream status, when to remove it.
verl_twin = functools.partial(runtime_patch, target="verl-project/verl", distribution="verl",
                              versions=">=0.9.1,<0.10.0", upstream_status="Pending", forwarded="no",
                              remove_when="verl>=0.10.0")
