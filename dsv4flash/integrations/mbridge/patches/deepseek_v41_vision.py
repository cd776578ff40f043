"""Runtime twin of DSV41-MBRIDGE-006: the DeepSeek-V4.1 ViT and 3x3 aligner in the Megatron model (DeepSeekV41VLModel).

Why: with DSV41-MBRIDGE-001 (and -005's image-token expert bias) the V4.1 bridge refuses a checkpoint's
vision-tower, aligner and image-delimiter tensors: they have no Megatron parameters to load into, so image
prompts cannot be trained or served through megatron-bridge.

How: the format-patch adds `deepseek_v41_vision.py` (ViT and aligner on megatron-core's parallel linears, with
ModuleSpecs) and `deepseek_v41_vl_model.py` (`DeepSeekV41VLModel`: the provider's GPTModel as `language_model`
plus `vision_model` and `vision_projection`), and edits 001's provider (vision fields; builds the VL model when
`vision_num_layers > 0`) and bridge (vision fields and mappings, `language_model.` prefix, registered for both
model classes). Those are new upstream modules and dataclass fields, so the runtime copy is shipped: the new files
under `_upstream/` are byte-identical to the patch's, and `_upstream/`'s provider and bridge are 001's with this
patch's edits; the DSV41-MBRIDGE-001 twin executes them (with `vision_num_layers == 0` they build and map exactly
what 001 alone does, which 001's tests check). DSV41-MBRIDGE-005's twin then replaces four attributes for its
text-decoder-only view of a vision config; this twin, applied after it, replaces them again with the patched
tree's combination of both: `provider_kwargs_from_hf` = the shipped one plus 005's modality-bias option,
`refuse_unmapped_vision_tensors` / `provider_bridge` refuse vision tensors only for a config without a vision
tower, `mapping_registry` = the
shipped one plus 005's `bias_vl` mapping under the model's prefix, `provide` = the shipped one and the
`token_types` -> `modality_mask` hook of 005 on the language model (`provide_language_model`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import types

from dsv4flash.patching.twins import MARKER, Patcher
from dsv4flash.integrations.mbridge.patches import import_bridge, mbridge_twin

PATCH_ID = "DSV41-MBRIDGE-006"
PACKAGE = "megatron.bridge.models.deepseek_v41"
OPTION = "moe_router_modality_expert_bias"
VISION_TENSOR_PREFIXES = ("vision.", "aligner.", "image_start", "image_newline", "image_end")
TOUCHES = (f"{PACKAGE}.deepseek_v41_vision.DeepSeekV41VisionModel",
           f"{PACKAGE}.deepseek_v41_vision.DeepSeekV41VisionProjection",
           f"{PACKAGE}.deepseek_v41_vision.get_deepseek_v41_vision_layer_spec",
           f"{PACKAGE}.deepseek_v41_vl_model.DeepSeekV41VLModel",
           f"{PACKAGE}.deepseek_v41_provider.DeepSeekV41ModelProvider",
           f"{PACKAGE}.deepseek_v41_bridge.DeepSeekV41Bridge",
           f"{PACKAGE}.deepseek_v41_bridge.vision_provider_kwargs_from_hf")


def carries_vision(package) -> bool:
    """Whether a loaded `models.deepseek_v41` package has the VL model and the vision provider fields."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(package.DeepSeekV41ModelProvider)}
    return hasattr(package, "DeepSeekV41VLModel") and {"vision_num_layers", "vision_downsample_ratio"} <= fields


def upstream_has_vision() -> bool:
    """Probe: does the installed megatron-bridge's own `models.deepseek_v41` (not a twin's files) have the ViT?"""
    import_bridge()
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None and getattr(loaded, MARKER, None):
        return False
    if loaded is None and importlib.util.find_spec(PACKAGE) is None:
        return False
    return carries_vision(importlib.import_module(PACKAGE))


def vision_module() -> types.ModuleType:
    """`megatron.bridge.models.deepseek_v41.deepseek_v41_vision`: the installed one, else this twin's (applied)."""
    name = f"{PACKAGE}.deepseek_v41_vision"
    if name not in sys.modules and not upstream_has_vision():
        from dsv4flash.patching import twins

        twins.discover()
        if not twins.REGISTRY.get(PATCH_ID).apply().active:
            raise RuntimeError(f"{PATCH_ID}: the V4.1 vision tower needs this twin or a megatron-bridge with the patch "
                               "applied; the twin was not applied (its log line says why)")
    return importlib.import_module(name)


@mbridge_twin(
    patch_id=PATCH_ID,
    touches=TOUCHES,
    gate="DSV4FLASH_MBRIDGE_DEEPSEEK_V41_VISION",
    tests=("tests/patches/test_mbridge_deepseek_v41_vision.py",),
    # The patch's `Depends-On: DSV41-MBRIDGE-001, DSV41-MBRIDGE-005, megatron-lm/DSV41-MCORE-006, -011`: the V4.1
    # package, its image-token expert bias, and what they build on in megatron-core.
    depends_on=("DSV41-MBRIDGE-001", "DSV41-MBRIDGE-005", "DSV41-MCORE-006", "DSV41-MCORE-011"),
    upstream_has_it=upstream_has_vision,
)
def install(patcher: Patcher) -> None:
    """Check the shipped package has 006; stack the patched tree's provider / bridge entry points on 005's."""
    package = importlib.import_module(PACKAGE)
    if not carries_vision(package):
        origin = "the installed megatron-bridge" if not getattr(package, MARKER, None) else "the shipped _upstream/"
        raise RuntimeError(f"{PATCH_ID}: {PACKAGE} from {origin} has no DeepSeekV41VLModel or no vision_* provider "
                           "fields; install a megatron-bridge with the patch applied (dsv4flash patches apply)")
    from megatron.bridge.models.deepseek_v41 import deepseek_v41_bridge as bridge
    from megatron.bridge.models.deepseek_v41 import deepseek_v41_provider as provider

    shipped_kwargs = inspect.unwrap(bridge.provider_kwargs_from_hf)
    shipped_registry = inspect.unwrap(bridge.DeepSeekV41Bridge.mapping_registry)
    shipped_provide = inspect.unwrap(provider.DeepSeekV41ModelProvider.provide)
    shipped_language_model = provider.DeepSeekV41ModelProvider.provide_language_model
    modality_mapping = bridge.ModalityExpertBiasMapping  # added by the DSV41-MBRIDGE-005 twin

    @functools.wraps(shipped_kwargs)
    def provider_kwargs_from_hf(hf_config):
        kwargs = shipped_kwargs(hf_config)
        if kwargs.get("vision_num_layers"):  # the release gives every gate a selection bias for image tokens
            kwargs[OPTION] = True
        return kwargs

    def refuse_unmapped_vision_tensors(names) -> None:
        """Raise on the first vision-tower / aligner tensor (for a config without a vision tower, which has none)."""
        for name in names:
            if name.startswith(VISION_TENSOR_PREFIXES):
                raise ValueError(f"{name}: a vision-tower / aligner tensor, but vision_config.num_hidden_layers is 0 "
                                 "(the model built for this config has no vision tower)")

    bias_vl_provider_bridge = bridge.DeepSeekV41Bridge.provider_bridge  # DSV41-MBRIDGE-005's

    @functools.wraps(bias_vl_provider_bridge)
    def provider_bridge(self, hf_pretrained):
        if not bridge._has_vision(hf_pretrained.config):
            state = getattr(hf_pretrained, "state", None)
            refuse_unmapped_vision_tensors(state.keys() if state is not None else ())
        # 005's body, without its unconditional vision-tensor refusal (it reads only `config` and `state`).
        return bias_vl_provider_bridge(self, types.SimpleNamespace(config=hf_pretrained.config, state=None))

    @functools.wraps(shipped_registry)
    def mapping_registry(self):
        from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

        registry = shipped_registry(self)
        kwargs = bridge.provider_kwargs_from_hf(self.hf_config) if self.hf_config is not None else {}
        vision = bool(kwargs.get("vision_num_layers"))
        layer = ("language_model." if vision else "") + "decoder.layers.*"
        bias_vl = modality_mapping(f"{layer}.mlp.router.modality_expert_bias.expert_bias", "layers.*.ffn.gate.bias_vl")
        return MegatronMappingRegistry(*registry.mappings, bias_vl)

    @functools.wraps(shipped_provide)
    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        return shipped_provide(self, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    @functools.wraps(shipped_language_model)
    def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None):
        model = shipped_language_model(self, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        provider.attach_modality_mask(model)
        return model

    patcher.replace(bridge, "provider_kwargs_from_hf", provider_kwargs_from_hf)
    patcher.replace(bridge, "refuse_unmapped_vision_tensors", refuse_unmapped_vision_tensors)
    patcher.replace(bridge.DeepSeekV41Bridge, "provider_bridge", provider_bridge)
    patcher.replace(bridge.DeepSeekV41Bridge, "mapping_registry", mapping_registry)
    patcher.replace(provider.DeepSeekV41ModelProvider, "provide", provide)
    patcher.replace(provider.DeepSeekV41ModelProvider, "provide_language_model", provide_language_model)
