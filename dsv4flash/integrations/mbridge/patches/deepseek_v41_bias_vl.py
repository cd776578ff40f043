"""Runtime twin of DSV41-MBRIDGE-005: DeepSeek-V4.1's image-token expert bias (`bias_vl`) from `token_types`.

Why: every gate of the V4.1 release holds `ffn.gate.bias` (text tokens) and `ffn.gate.bias_vl` (image-span
tokens); the DSV41-MBRIDGE-001 bridge maps neither `bias_vl` nor routes image tokens with it, and refuses any
config with a vision tower, so a checkpoint with its text decoder and `bias_vl` gates cannot be imported.

How: on the modules the DSV41-MBRIDGE-001 twin provides, as in the format-patch: `provider_kwargs_from_hf` adds
`moe_router_modality_expert_bias=True` for a config with a vision tower (the vision field is no longer refused);
`DeepSeekV41Bridge.provider_bridge` refuses vision-tower / aligner / image-delimiter tensors by name
(`refuse_unmapped_vision_tensors`) and, on a stock megatron-core whose `TransformerConfig` lacks the field of
DSV41-MCORE-004, sets the option as an attribute of the built provider (the router twin reads it with
`getattr`); `mapping_registry` adds `layers.*.ffn.gate.bias_vl` <->
`decoder.layers.*.mlp.router.modality_expert_bias.expert_bias` (`ModalityExpertBiasMapping`: the bias is a
buffer of a module without parameters, where `ReplicatedMapping` looks for the target device);
`DeepSeekV41ModelProvider.provide` attaches `attach_modality_mask` (`token_types >= 0` -> `GPTModel.forward(modality_mask=)`, DSV41-MCORE-012).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Iterable

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mbridge.patches import mbridge_twin

PACKAGE = "megatron.bridge.models.deepseek_v41"
TOUCHES = (f"{PACKAGE}.deepseek_v41_bridge.provider_kwargs_from_hf",
           f"{PACKAGE}.deepseek_v41_bridge.refuse_unmapped_vision_tensors",
           f"{PACKAGE}.deepseek_v41_bridge.ModalityExpertBiasMapping",
           f"{PACKAGE}.deepseek_v41_bridge.DeepSeekV41Bridge.provider_bridge",
           f"{PACKAGE}.deepseek_v41_bridge.DeepSeekV41Bridge.mapping_registry",
           f"{PACKAGE}.deepseek_v41_provider.DeepSeekV41ModelProvider.provide",
           f"{PACKAGE}.deepseek_v41_provider.attach_modality_mask")
# Release tensors of the vision tower, the aligner and the image delimiters (not mapped yet).
VISION_TENSOR_PREFIXES = ("vision.", "aligner.", "image_start", "image_newline", "image_end")
OPTION = "moe_router_modality_expert_bias"


def refuse_unmapped_vision_tensors(names: Iterable[str]) -> None:
    """Raise on the first vision-tower / aligner tensor: this bridge does not map them yet."""
    for name in names:
        if name.startswith(VISION_TENSOR_PREFIXES):
            raise ValueError(
                f"{name}: the V4.1 vision tower and aligner tensors are not mapped by this bridge yet "
                "(a checkpoint with the text decoder and its bias_vl gates is)"
            )


def attach_modality_mask(model) -> None:
    """Let ``model``'s forward take ``token_types`` [b, s]: image-span tokens (``>= 0``) route with ``bias_vl``.

    With ``moe_router_modality_expert_bias`` the mask ``token_types >= 0`` is passed to ``GPTModel.forward`` as
    ``modality_mask`` (the image mask Engram uses, too); the keyword is left for the Engram hook when the
    model has one, which runs after this hook.
    """
    routes_images = bool(getattr(model.config, "moe_router_modality_expert_bias", False))

    def take_token_types(module, args, kwargs):
        engram = getattr(module, "engram_hasher", None) is not None
        token_types = kwargs.get("token_types") if engram else kwargs.pop("token_types", None)
        if token_types is not None and routes_images:
            kwargs["modality_mask"] = token_types >= 0
        return args, kwargs

    model.register_forward_pre_hook(take_token_types, with_kwargs=True, prepend=True)


def _vision_layers(bridge, hf_config: Any) -> int:
    return bridge._field(bridge._field(hf_config, "vision_config") or {}, "num_hidden_layers", 0) or 0


def _without_vision_tower(hf_config: Any) -> Any:
    """A copy of the config whose vision tower has no layers (what the 001 body accepts)."""
    hf_config = copy.deepcopy(hf_config)
    vision = hf_config["vision_config"] if isinstance(hf_config, dict) else hf_config.vision_config
    if isinstance(vision, dict):
        vision["num_hidden_layers"] = 0
    else:
        vision.num_hidden_layers = 0
    return hf_config


def _provider_kwargs(bridge, original):
    """`provider_kwargs_from_hf` that turns the modality bias on for a config with a vision tower."""

    @functools.wraps(original)
    def provider_kwargs_from_hf(hf_config: Any):
        if not _vision_layers(bridge, hf_config):
            return original(hf_config)
        kwargs = original(_without_vision_tower(hf_config))
        kwargs[OPTION] = True  # the release gives every gate a selection bias for image-span tokens (bias_vl)
        return kwargs

    return provider_kwargs_from_hf


def _provider_bridge(bridge, provider_cls):
    """`DeepSeekV41Bridge.provider_bridge` refusing vision tensors; the option set on the built provider."""

    def provider_bridge(self, hf_pretrained):
        """A provider for the checkpoint's config, in the checkpoint's wide dtype (bf16) unless overridden."""
        import torch

        state = getattr(hf_pretrained, "state", None)
        bridge.refuse_unmapped_vision_tensors(state.keys() if state is not None else ())
        hf_config = hf_pretrained.config
        dtype = bridge._field(hf_config, "dtype") or bridge._field(hf_config, "torch_dtype") or torch.bfloat16
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        kwargs = bridge.provider_kwargs_from_hf(hf_config)
        modality = kwargs.pop(OPTION, False)
        if OPTION in {f.name for f in dataclasses.fields(provider_cls)}:
            kwargs[OPTION] = modality
        provider = provider_cls(**kwargs, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                fp16=dtype == torch.float16)
        if modality:  # stock TransformerConfig lacks the field; the DSV41-MCORE-004 twin reads the attribute
            setattr(provider, OPTION, True)
        return provider

    return provider_bridge


def _modality_expert_bias_mapping():
    """The patch's `ModalityExpertBiasMapping` (a class of megatron-bridge's, built when the twin installs)."""
    from types import SimpleNamespace

    from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping

    class ModalityExpertBiasMapping(ReplicatedMapping):
        """``ReplicatedMapping`` of a router's modality expert bias: a buffer of a module without parameters."""

        def hf_to_megatron(self, hf_weights, megatron_module):
            """Replicate the bias to all TP ranks, on the device of the module's ``expert_bias`` buffer."""
            # ReplicatedMapping places the weight on the module's ``weight`` (else first parameter) device.
            return super().hf_to_megatron(hf_weights, SimpleNamespace(weight=megatron_module.expert_bias))

    return ModalityExpertBiasMapping


def _mapping_registry(original, mapping_cls):
    """`DeepSeekV41Bridge.mapping_registry` with `ffn.gate.bias_vl` mapped."""

    @functools.wraps(original)
    def mapping_registry(self):
        from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

        bias_vl = mapping_cls("decoder.layers.*.mlp.router.modality_expert_bias.expert_bias",
                              "layers.*.ffn.gate.bias_vl")
        return MegatronMappingRegistry(*original(self).mappings, bias_vl)

    return mapping_registry


def _provide(original):
    """`DeepSeekV41ModelProvider.provide` whose model takes `token_types` for the MoE modality mask."""

    @functools.wraps(original)
    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        model = original(self, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        attach_modality_mask(model)
        return model

    return provide


def upstream_maps_bias_vl() -> bool:
    """Probe: does the installed V4.1 bridge map `ffn.gate.bias_vl`?"""
    try:
        from megatron.bridge.models.deepseek_v41.deepseek_v41_bridge import DeepSeekV41Bridge
    except ImportError:
        return False
    return DeepSeekV41Bridge().mapping_registry().hf_to_megatron_lookup("layers.0.ffn.gate.bias_vl") is not None


@mbridge_twin(
    patch_id="DSV41-MBRIDGE-005",
    touches=TOUCHES,
    gate="DSV4FLASH_MBRIDGE_DEEPSEEK_V41_BIAS_VL",
    tests=("tests/patches/test_mbridge_deepseek_v41_bias_vl.py",),
    # The patch's `Depends-On: DSV41-MBRIDGE-001, megatron-lm/DSV41-MCORE-012` (the V4.1 bridge; the modality
    # mask threaded from GPTModel to the routers, which pulls in the router's modality bias of -004).
    depends_on=("DSV41-MBRIDGE-001", "DSV41-MCORE-012"),
    upstream_has_it=upstream_maps_bias_vl,
)
def install(patcher: Patcher) -> None:
    """Map `bias_vl`, turn the modality bias on for vision configs and route `token_types` image tokens."""
    from megatron.bridge.models.deepseek_v41 import deepseek_v41_bridge as bridge
    from megatron.bridge.models.deepseek_v41 import deepseek_v41_provider as provider

    patcher.add(bridge, "refuse_unmapped_vision_tensors", refuse_unmapped_vision_tensors)
    patcher.add(provider, "attach_modality_mask", attach_modality_mask)
    patcher.replace(bridge, "provider_kwargs_from_hf", _provider_kwargs(bridge, bridge.provider_kwargs_from_hf))
    patcher.replace(bridge.DeepSeekV41Bridge, "provider_bridge",
                    _provider_bridge(bridge, provider.DeepSeekV41ModelProvider))
    mapping_cls = _modality_expert_bias_mapping()
    patcher.add(bridge, "ModalityExpertBiasMapping", mapping_cls)
    patcher.replace(bridge.DeepSeekV41Bridge, "mapping_registry",
                    _mapping_registry(bridge.DeepSeekV41Bridge.mapping_registry, mapping_cls))
    patcher.replace(provider.DeepSeekV41ModelProvider, "provide", _provide(provider.DeepSeekV41ModelProvider.provide))
