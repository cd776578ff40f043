"""vLLM integration: `register()` is the `vllm.general_plugins` entry point (lazy, idempotent, re-entrant).

vLLM calls it in every process (API server, engine core, workers). It applies the vLLM runtime twins in
`patches/` (each decides from its gate variable, the installed vLLM and an upstream probe whether it is needed):

* DSV41-VLLM-001 — `DeepseekV41ForCausalLM` resolves to `model.DeepseekV41ForCausalLMWithLoRA` (LoRA on the
  language model, ViT and aligner; per-image vision adapters). Applied at once: it only edits the registry
  with a lazy string, so no model code is imported.
* DSV41-VLLM-002 — block-diagonal LoRA on the grouped output projection `wo_a`, applied in the o-projection;
* DSV41-VLLM-003 — LoRA on the compressor's `wkv`/`wgate`, applied to the fp32 score.
  These two patch V4.1 model modules; they are applied when the model is built (the model class calls
  `register(model_code=True)`), so API-server processes never import GPU model code.

With `DSV4FLASH_LORA_STORE` set it also registers a `LoRAResolver` over the adapter catalog
(`lora_resolver.py`: `model="<policy>:<tag>"`). See docs/vllm.md for enabling it in a deployment.
"""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger("dsv4flash.vllm")
DISTRIBUTION = "vllm"
REGISTRY_TWINS = ("DSV41-VLLM-001",)
MODEL_CODE = "vllm.models.deepseek_v41.attention"  # loaded => the V4.1 model code is in this process
_lock = threading.Lock()


def register(model_code: bool = False) -> dict:
    """Apply the vLLM twins (model-code twins only with `model_code` or once V4.1 code is loaded)."""
    from dsv4flash.patching import twins

    outcomes = {}
    with _lock:
        registry = twins.discover()
        load_all = model_code or MODEL_CODE in sys.modules
        for twin in registry.all():
            if twin.meta.distribution != DISTRIBUTION:
                continue
            if twin.meta.patch_id in REGISTRY_TWINS or load_all:
                outcomes[twin.meta.patch_id] = twin.apply(registry=registry)
    for patch_id, outcome in outcomes.items():
        log.debug("%s: %s", patch_id, outcome.value)
    from dsv4flash.integrations.vllm.lora_resolver import register_catalog_resolver

    register_catalog_resolver()  # only when DSV4FLASH_LORA_STORE names a store (idempotent)
    return outcomes
