"""`DSV41BridgeModelProvider`: `DSV41ModelProvider` as a Megatron-Bridge `ModelProviderMixin`.

Megatron-Bridge's own providers *are* `TransformerConfig`s (`GPTModelProvider(TransformerConfig,
ModelProviderMixin)`): callers set Megatron fields by name (`provider.tensor_model_parallel_size = 2`,
`apply_overrides_and_finalize(dtype=..., overrides={...})`), register pre/post-wrap hooks (PEFT, weight
loading) and build the wrapped model with `provide_distributed_model`. veRL's Megatron engine drives exactly
that interface. This provider keeps `DSV41ModelProvider.provide()` (the V4.1 config is the architecture's
source of truth, `CSA2TransformerConfig` is built from it) and routes every megatron-core `TransformerConfig`
field set on it into `overrides` (read back as set; a field not set reads as the config built without
overrides), and `finalize()` validates the whole, like the deferred post-init of upstream providers.

    provider = AutoBridge.from_hf_pretrained(path).to_megatron_provider(load_weights=False)
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides={"expert_model_parallel_size": 2})
    provider.register_pre_wrap_hook(create_peft_hook(peft, training=True))
    model = provider.provide_distributed_model(ddp_config=ddp_config)   # [DDP(DSV41MegatronModel)]
    peft = provider.provide_peft({"rank": 16, "alpha": 32, "target_modules": [...]})   # DSV41LoRA (veRL asks)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron.bridge.models.model_provider import ModelProviderMixin
from megatron.core.transformer.transformer_config import TransformerConfig

from dsv4flash.integrations.mcore.csa2.model import DSV41MegatronModel
from dsv4flash.integrations.mcore.csa2.provider import DSV41ModelProvider

__all__ = ["DSV41BridgeModelProvider", "MEGATRON_FIELDS"]

# The megatron-core fields a caller may set on the provider (they become `overrides`). The provider's own
# fields keep their meaning, including `moe_grouped_gemm`, which means the same in both.
MEGATRON_FIELDS = frozenset(f.name for f in dataclasses.fields(TransformerConfig)) - frozenset(
    f.name for f in dataclasses.fields(DSV41ModelProvider))


@dataclass
class DSV41BridgeModelProvider(DSV41ModelProvider, ModelProviderMixin[DSV41MegatronModel]):
    """A `DSV41ModelProvider` with Megatron-Bridge's hooks, finalize and `provide_distributed_model`."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in MEGATRON_FIELDS and "overrides" in self.__dict__:
            self.overrides[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not real attributes. A megatron-core field not overridden reads as
        # the config built without overrides: callers set fields one at a time (recompute_granularity before
        # recompute_method), so the half-overridden config must not be validated until `finalize()`.
        if name not in MEGATRON_FIELDS or "overrides" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        if name in self.overrides:
            return self.overrides[name]
        return getattr(dataclasses.replace(self, overrides={}).transformer_config(), name)

    def provide_peft(self, lora_cfg: Any, dtype: Any = None):
        """Megatron-Bridge's LoRA from a veRL-style `lora` mapping, as `DSV41LoRA` (grouped `wo_a` adapters too)."""
        from megatron.bridge.peft.utils import create_peft

        from dsv4flash.integrations.mbridge.grouped_lora import DSV41LoRA

        kind = lora_cfg.get("type", "lora")
        if kind != "lora":
            raise ValueError(f"lora.type: DeepSeek-V4.1 on Megatron supports 'lora' (with block-diagonal adapters on "
                             f"the grouped wo_a projection), got {kind!r}")
        generic = create_peft(lora_cfg, dtype=dtype)  # upstream's own parsing of the mapping
        if generic is None:
            return None
        return DSV41LoRA(**{f.name: getattr(generic, f.name) for f in dataclasses.fields(generic) if f.init})

    def finalize(self) -> None:
        """Validate the overrides now (build the `CSA2TransformerConfig` once), as upstream providers do."""
        self.transformer_config()
