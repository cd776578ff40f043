"""veRL integration: `register()` applies the veRL runtime twins (lazy, idempotent).

veRL loads `verl.plugins` entry points on `import verl` by *importing* them (it never calls anything), so
the entry point names the module `dsv4flash.integrations.verl.plugin`, whose import calls `register()`.
Each twin is applied when the veRL module it patches is imported (`TRIGGERS`; at once if it already is), so
a process never imports what it does not use. A twin whose module cannot be imported in this process (no
vLLM on a trainer node, no megatron-core on a rollout node) is skipped and reported, never half-applied:

* DSV41-VERL-001 — in-memory adapter loader for vLLM 0.33 (`get_rename_mapper`, `mtp.` skip, EP filtering,
  3-D MoE flag, validations), installed by chaining `VLLMHijack.hijack`;
* DSV41-VERL-002 — MXFP4 MoE refit unwraps vLLM's LoRA `FusedMoEModularMethod`;
* DSV41-VERL-003 — unmerged sync reconciles `.base_layer.` names by probing the live loader;
* DSV41-VERL-004 — text-only R3 routing replay for image-span sequences;
* DSV41-VERL-005 — adapter syncs reset vLLM's encoder cache (vision outputs are adapter-dependent);
* DSV41-VERL-006 — the default process-group backend on a CPU platform is `cpu:gloo`;
* DSV41-VERL-007 — the Ray resource check counts the platform's own resource;
* DSV41-VERL-008 — `register_rollout`, a public register function for rollout backends;
* DSV41-VERL-009 — the Megatron engine takes a provider's own PEFT (`provider.provide_peft`);
* DSV41-VERL-010 — the Megatron engine accepts `dtype=float32` (full precision);
* DSV41-VERL-011 — `hf_processor` keeps the processor of a multimodal model with 1-D RoPE (V4.1's);
* DSV41-VERL-012 — the Megatron forward functions pass every multimodal input the model's forward declares;
* DSV41-VERL-013 — the agent loop asks the processor where recorded routes replay (`r3_row_map`, `r3_native_rows`);
* DSV41-VERL-014 — token-aligned multimodal inputs (V4.1's `token_types`) come from the trajectory's token ids.

Loading the plugin also registers the CPU development platform (`cpu_platform`, `VERL_PLATFORM=cpu`) and,
once `megatron.bridge` is imported, the project's Megatron-Bridge bridge (`register_bridge_when_imported`).

See docs/verl.md.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("dsv4flash.verl")
DISTRIBUTION = "verl"
# Re-entrant: a twin's own install may import its trigger module, which fires the post-import hook
# (scheduled by the `verl.plugins` entry point) on this same thread.
_lock = threading.RLock()
_applying: set[str] = set()


# The veRL module whose import makes each twin applicable (and that the twin patches or feeds).
TRIGGERS = {
    "DSV41-VERL-001": "verl.workers.rollout.vllm_rollout.utils",  # before its worker extension runs the hijack
    "DSV41-VERL-002": "verl.utils.vllm.vllm_quant_utils",
    "DSV41-VERL-003": "verl.workers.rollout.vllm_rollout.utils",
    "DSV41-VERL-004": "verl.workers.engine.megatron.transformer_impl",
    "DSV41-VERL-005": "verl.workers.rollout.vllm_rollout.vllm_async_server",
    "DSV41-VERL-006": "verl.utils.distributed",
    "DSV41-VERL-007": "verl.single_controller.ray.base",
    "DSV41-VERL-008": "verl.workers.rollout.base",
    "DSV41-VERL-009": "verl.workers.config.megatron_peft",
    "DSV41-VERL-010": "verl.workers.config.engine",
    "DSV41-VERL-011": "verl.workers.config.model",  # veRL's processor consumer; verl.utils is complete by then
    "DSV41-VERL-012": "verl.models.mcore",  # the package: its registry binds the forward functions by name
    "DSV41-VERL-013": "verl.experimental.agent_loop.agent_loop",  # also patches padding (imported by then)
    "DSV41-VERL-014": "verl.experimental.agent_loop.agent_loop",
}
OUTCOMES: dict = {}


def apply(patch_id: str):
    """Apply one veRL twin now; records and returns its `Outcome` (or the ImportError that skipped it)."""
    from dsv4flash.patching import twins

    with _lock:
        if patch_id in _applying:  # fired again from inside its own install: the outer call finishes it
            return OUTCOMES.get(patch_id)
        _applying.add(patch_id)
        try:
            registry = twins.discover()
            try:
                outcome = registry.get(patch_id).apply(registry=registry)
            except ImportError as exc:  # the module it patches needs a package this process lacks
                log.info("%s skipped here: %s", patch_id, exc)
                outcome = exc
            OUTCOMES[patch_id] = outcome
            return outcome
        finally:
            _applying.discard(patch_id)


def register_bridge_when_imported() -> None:
    """Register the project's Megatron-Bridge bridge (`DeepseekV41ForCausalLM`) as soon as a veRL worker imports
    `megatron.bridge`: veRL's Megatron engine builds its model with `AutoBridge.from_hf_pretrained`."""
    from dsv4flash.patching.post_import import when_imported

    def register_bridge() -> None:
        from dsv4flash.integrations import mbridge

        mbridge.register()

    when_imported("megatron.bridge", register_bridge)


def register(now: bool = False) -> dict:
    """Schedule every veRL twin for when its module is imported (`now=True`: apply all at once)."""
    from dsv4flash.patching import twins
    from dsv4flash.patching.post_import import when_imported

    patch_ids = [t.meta.patch_id for t in twins.discover().all() if t.meta.distribution == DISTRIBUTION]
    missing = sorted(set(patch_ids) - set(TRIGGERS))
    if missing:
        raise RuntimeError(f"veRL twins without an import trigger: {missing}")
    for patch_id in patch_ids:
        if now:
            apply(patch_id)
        else:
            when_imported(TRIGGERS[patch_id], lambda pid=patch_id: apply(pid))
    return dict(OUTCOMES)
