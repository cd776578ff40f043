"""Runtime twin of DSV41-VERL-009: the Megatron engine takes a provider's own PEFT (`provider.provide_peft`).

Why: `verl.workers.config.megatron_peft.get_peft_cls` always builds Megatron-Bridge's generic PEFT
(`create_peft`: LoRA, DoRA, canonical LoRA from a closed table). A model with layers those adapters cannot
wrap has no way in: DeepSeek-V4.1's grouped output projection (`linear_o_group_proj`, a grouped einsum, not a
linear) makes the PEFT pre-wrap hook fail with "Layer type is unrecognized for LoRA", and a generic adapter
over its concatenated input would add cross-group terms anyway.

How: when the Megatron-Bridge provider defines `provide_peft(lora_cfg, dtype=...)`, veRL uses what it
returns; every other provider gets `create_peft` as before.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = ("verl.workers.config.megatron_peft.get_peft_cls",)


def upstream_takes_provider_peft() -> bool:
    """Probe: does veRL's `get_peft_cls` return what a provider's `provide_peft` builds?"""
    from verl.workers.config.megatron_peft import get_peft_cls

    built = object()

    class ProbeProvider:
        def provide_peft(self, lora_cfg, dtype=None):
            return built

    class ProbeModelConfig:
        lora = {"type": "lora", "rank": 1}

    return get_peft_cls(ProbeModelConfig(), bridge=object(), provider=ProbeProvider()) is built


@verl_twin(
    patch_id="DSV41-VERL-009",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_PROVIDER_PEFT",
    tests=("tests/verl/test_provider_peft.py",),
    upstream_has_it=upstream_takes_provider_peft,
)
def install(patcher: Patcher) -> None:
    """Replace `get_peft_cls` (the engine imports it from its module at call time)."""
    from verl.workers.config import megatron_peft

    def get_peft_cls(model_config, bridge, provider, dtype=None):
        """Create a Megatron-Bridge PEFT object from `model_config.lora` (the provider's `provide_peft` first)."""
        if not hasattr(model_config, "lora"):
            return None
        lora_cfg = model_config.lora
        if lora_cfg.get("rank", 0) <= 0:
            return None
        assert bridge is not None and provider is not None, "LoRA/PEFT only supported via Megatron-Bridge"
        provide_peft = getattr(provider, "provide_peft", None)
        if callable(provide_peft):
            peft_cls = provide_peft(lora_cfg, dtype=dtype)
        else:
            from megatron.bridge.peft.utils import create_peft

            peft_cls = create_peft(lora_cfg, dtype=dtype)
        print(f"Enabling {lora_cfg.get('type', 'lora').upper()} with rank={lora_cfg.get('rank')}, "
              f"alpha={lora_cfg.get('alpha')}, dropout={lora_cfg.get('dropout')}")
        return peft_cls

    patcher.replace(megatron_peft, "get_peft_cls", get_peft_cls)
