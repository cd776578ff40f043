"""Runtime twin of DSV41-MBRIDGE-006: the DeepSeek-V4.1 ViT and 3x3 aligner in the Megatron model (`DeepSeekV41VLModel`).

Why: with DSV41-MBRIDGE-001 alone the V4.1 bridge refuses a checkpoint with a vision tower (`vision_config.
num_hidden_layers`): its `vision.*` / `aligner.*` / image-delimiter tensors have no Megatron parameters to load
into, so image prompts cannot be trained or served through megatron-bridge.

How: the format-patch adds `deepseek_v41_vision.py` (ViT and aligner on megatron-core's parallel linears, with
ModuleSpecs) and `deepseek_v41_vl_model.py` (`DeepSeekV41VLModel`: the provider's GPTModel as `language_model`
plus `vision_model` and `vision_projection`), and edits DSV41-MBRIDGE-001's provider (builds the VL model when
`vision_num_layers > 0`) and bridge (vision fields and mappings, `language_model.` prefix, registered for both
model classes). These are new upstream modules, so there is one runtime copy: the files under `_upstream/` are
byte-identical to this patch's patched tree (001 then 006), and the DSV41-MBRIDGE-001 twin executes them; with
`vision_num_layers == 0` they build and map exactly what 001 alone does, which 001's tests check. This twin
therefore installs nothing: it confirms that the `models.deepseek_v41` package in use carries this change and
refuses (one line) a megatron-bridge that ships that package without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from dsv4flash._patching import MARKER, Patcher
from dsv4flash.integrations.mbridge.patches import import_bridge, mbridge_twin

PATCH_ID = "DSV41-MBRIDGE-006"
PACKAGE = "megatron.bridge.models.deepseek_v41"
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


@mbridge_twin(
    patch_id=PATCH_ID,
    touches=TOUCHES,
    gate="DSV4FLASH_MBRIDGE_DEEPSEEK_V41_VISION",
    tests=("tests/patches/test_mbridge_deepseek_v41_vision.py",),
    # The patch's `Depends-On: DSV41-MBRIDGE-001, megatron-lm/DSV41-MCORE-006, -011`: the V4.1 package and what it
    # builds on in megatron-core (host row-lookup Engram tables; CSA2 / mHC with layer kind C and YaRN).
    depends_on=("DSV41-MBRIDGE-001", "DSV41-MCORE-006", "DSV41-MCORE-011"),
    upstream_has_it=upstream_has_vision,
)
def install(patcher: Patcher) -> None:
    """Check that the V4.1 package provided by DSV41-MBRIDGE-001's twin (the shared `_upstream/` files) has 006."""
    package = importlib.import_module(PACKAGE)
    if not carries_vision(package):
        origin = "the installed megatron-bridge" if not getattr(package, MARKER, None) else "the shipped _upstream/"
        raise RuntimeError(f"{PATCH_ID}: {PACKAGE} from {origin} has no DeepSeekV41VLModel or no vision_* provider "
                           "fields; install a megatron-bridge with the patch applied (dsv4flash patches apply)")
