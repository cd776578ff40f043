"""Megatron-Bridge integration: `register()` makes `AutoBridge` handle `DeepseekV41ForCausalLM` (lazy, idempotent).

Importing this package imports nothing from megatron-bridge. `register()` imports it, then registers
`DSV41Bridge` for the string source "DeepseekV41ForCausalLM" (absent from transformers) with target
`DSV41MegatronModel`, provider `DSV41BridgeModelProvider` (`DSV41ModelProvider` as a
`ModelProviderMixin`) and model type "deepseek_v41". Megatron-Bridge's registry
lets the last registration of a source win silently, so `register()` re-registers only when the dispatch no
longer resolves to this bridge (another plugin, or a future upstream V4.1 bridge, registered over it);
calling it again is otherwise a no-op. It also applies the megatron-bridge runtime twins
(`integrations/mbridge/patches/`, the upstream changes of `patches/megatron-bridge/`). Use:

    from dsv4flash.integrations import mbridge
    mbridge.register()
    auto = AutoBridge(mbridge.ReleasePretrained("/ckpt/DeepSeek-V4.1-Flash"))   # release layout, no transformers class
    model = mbridge.provider_for("/ckpt/DeepSeek-V4.1-Flash").provide()
    auto.load_hf_weights([model])                                               # FP8 32×32 / MXFP4 / Engram decoded
    mbridge.save_release(auto.export_hf_weights([model]), "/ckpt/DeepSeek-V4.1-Flash", "/out")   # bit-exact

See docs/bridge.md ("Megatron-Bridge").
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["register", "is_registered", "SOURCE", "MODEL_TYPE", "ReleasePretrained", "RowChunk", "save_release",
           "provider_for", "DSV41LoRA", "save_peft_adapter", "DSV41BridgeModelProvider"]

SOURCE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"
_lock = threading.Lock()
REGISTERED: set[str] = set()  # Patch-Ids register() found active, with their Depends-On: applied for the process
_LAZY = {"ReleasePretrained": "checkpoint", "save_release": "checkpoint", "RowChunk": "checkpoint",
         "DSV41LoRA": "grouped_lora", "save_peft_adapter": "peft_export", "DSV41BridgeModelProvider": "provider"}


def is_registered() -> bool:
    """Whether Megatron-Bridge's dispatch for "DeepseekV41ForCausalLM" currently yields this plugin's bridge."""
    import sys

    if "dsv4flash.integrations.mbridge.bridge" not in sys.modules:
        return False
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    from dsv4flash.integrations.mbridge.bridge import DSV41Bridge

    try:
        return type(get_model_bridge(SOURCE)) is DSV41Bridge
    except Exception:  # plum raises NotFoundLookupError when nothing is registered
        return False


def register() -> type:
    """Apply the megatron-bridge runtime twins, register `DSV41Bridge` (once; again only if something
    replaced it). Returns it."""
    with _lock:
        from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

        from dsv4flash.patching import twins

        twins.discover()
        outcomes = twins.REGISTRY.apply_all(distribution="megatron-bridge")  # idempotent; each twin checks its gate
        # an active twin's Depends-On are active too
        REGISTERED.update(twins.REGISTRY.with_dependencies(pid for pid, out in outcomes.items() if out.active))

        from dsv4flash.integrations.mbridge.bridge import DSV41Bridge
        from dsv4flash.integrations.mbridge.provider import DSV41BridgeModelProvider
        from dsv4flash.integrations.mcore.csa2 import DSV41MegatronModel

        if not is_registered():
            MegatronModelBridge.register_bridge(source=SOURCE, target=DSV41MegatronModel,
                                                provider=DSV41BridgeModelProvider,
                                                model_type=MODEL_TYPE)(DSV41Bridge)
        return DSV41Bridge


def provider_for(path: Any):
    """A `DSV41ModelProvider` for a release checkpoint directory (its `config.json`)."""
    from pathlib import Path

    from dsv4flash.config import load_config
    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider

    return DSV41ModelProvider(load_config(Path(path) / "config.json"))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"dsv4flash.integrations.mbridge.{_LAZY[name]}"), name)
    raise AttributeError(name)
