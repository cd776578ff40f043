"""vLLM integration: `register()` is the `vllm.general_plugins` entry point (lazy, idempotent, re-entrant).

vLLM calls it in every process (API server, engine core, workers). It imports nothing heavy itself; it
applies the vLLM runtime twins in `patches/` (each decides from its gate variable, the installed vLLM and an
upstream probe whether it is needed):

* DSV41-VLLM-001 — `DeepseekV41ForCausalLM` resolves to `model.DeepseekV41ForCausalLMWithLoRA` (LoRA on the
  language model, ViT and aligner; per-image vision adapters);
* DSV41-VLLM-002 — block-diagonal LoRA on the grouped output projection `wo_a`, applied in the o-projection;
* DSV41-VLLM-003 — LoRA on the compressor's `wkv`/`wgate`, applied to the fp32 score.

See docs/vllm.md for enabling it in a deployment.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("dsv4flash.vllm")
DISTRIBUTION = "vllm"
_lock = threading.Lock()


def register() -> dict:
    """Apply every vLLM runtime twin; returns Patch-Id -> `dsv4flash._patching.Outcome` (safe to call again)."""
    from dsv4flash import _patching

    with _lock:
        _patching.discover()
        outcomes = _patching.REGISTRY.apply_all(distribution=DISTRIBUTION)
    for patch_id, outcome in outcomes.items():
        log.debug("%s: %s", patch_id, outcome.value)
    return outcomes
