"""Runtime twins for vLLM 0.33, one module per upstream change (Patch-Id `DSV41-VLLM-NNN`).

| Patch-Id       | module              | change                                                                |
|----------------|---------------------|-----------------------------------------------------------------------|
| DSV41-VLLM-001 | `lora_model_class`  | V4.1 vision model declares LoRA (tower/connector mapping, per-image adapters) |
| DSV41-VLLM-002 | `grouped_wo_a`      | block-diagonal `wo_a` LoRA layer + o-projection call site              |
| DSV41-VLLM-003 | `compressor`        | compressor `fused_wkv_wgate` LoRA layer + fp32 score call site          |

Each registers with `dsv4flash.patching.twins.runtime_patch`; the upstream form of each lives in `patches/vllm/`
under the same Patch-Id. Importing these modules never imports vLLM; `install()` does.
"""

import functools

from dsv4flash.patching.twins import runtime_patch


# What every vLLM 0.33 twin shares: target, version window, upstream status, when to remove it.
vllm_twin = functools.partial(runtime_patch, target="vllm-project/vllm", distribution="vllm",
                              versions=">=0.33.0,<0.34.0", upstream_status="Pending", forwarded="no",
                              remove_when="vllm>=0.34.0")
