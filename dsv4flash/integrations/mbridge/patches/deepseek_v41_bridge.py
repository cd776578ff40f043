"""Runtime twin of DSV41-MBRIDGE-001: the DeepSeek-V4.1 bridge and provider on megatron-core's CSA2 and mHC layers.

Why: megatron-bridge 0.6.2 has no bridge for `DeepseekV41ForCausalLM`; its `DeepSeekV4Bridge` targets unreleased
megatron-core modules (`HyperConnectionModule`, `DSv4HybridSelfAttention`) and a 128-block FP8 format, and V4.1
has no `hc_head_*`, a nested config and 32x32 FP8 blocks.

How: the patch's new package `megatron.bridge.models.deepseek_v41` (`DeepSeekV41Bridge`, registered for
`DeepseekV41ForCausalLM` on import, and `DeepSeekV41ModelProvider`) is executed from the patch's own files
(`_upstream/`, byte-identical). It needs megatron-core's CSA2 / mHC modules with layer kind C and YaRN
(DSV41-MCORE-011 on -008 / -010; their twins on a stock megatron-core), DSV41-MBRIDGE-002's `block_size` and
DSV41-MBRIDGE-003's `StateDict.load_rows` (Engram tables are imported in row chunks) and DSV41-MCORE-006's
`HostRowLookupTable` (the Engram tables' default storage).
The project's own `DSV41Bridge` registers for the
same architecture; whichever registers last serves `AutoBridge` (megatron-bridge's dispatch rule).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from dsv4flash.patching.twins import MARKER, Patcher
from dsv4flash.integrations.mbridge.patches import import_bridge, mbridge_twin

PATCH_ID = "DSV41-MBRIDGE-001"
UPSTREAM_SOURCES = Path(__file__).resolve().parent / "_upstream"
PACKAGE = "megatron.bridge.models.deepseek_v41"
FOLDER = "src/megatron/bridge/models/deepseek_v41"
SUBMODULES = ("deepseek_v41_engram", "deepseek_v41_vision", "deepseek_v41_vl_model", "deepseek_v41_provider",
              "deepseek_v41_bridge")  # import order: dependencies first
TOUCHES = (f"{PACKAGE}.deepseek_v41_bridge.DeepSeekV41Bridge",
           f"{PACKAGE}.deepseek_v41_bridge.provider_kwargs_from_hf",
           f"{PACKAGE}.deepseek_v41_provider.DeepSeekV41ModelProvider",
           f"{PACKAGE}.deepseek_v41_provider.csa2_layer_pattern_from_hf",
           f"{PACKAGE}.deepseek_v41_engram.EngramHasher",
           f"{PACKAGE}.deepseek_v41_engram.EngramHyperConnectionTransformerLayer")


def upstream_has_deepseek_v41() -> bool:
    """Probe: does the installed megatron-bridge ship `models.deepseek_v41` (not this twin's)?"""
    import_bridge()
    if PACKAGE in sys.modules:
        return not getattr(sys.modules[PACKAGE], MARKER, None)
    return importlib.util.find_spec(PACKAGE) is not None


def _load(patcher: Patcher, name: str, path: Path, package: bool = False):
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[] if package else None)
    module = importlib.util.module_from_spec(spec)
    if package:  # an empty search path: its submodules are provided one by one, never found on disk
        module.__path__ = []
    patcher.provide_module(name, module)  # registered before it runs: dataclasses look their module up
    return spec, module


@mbridge_twin(
    patch_id=PATCH_ID,
    touches=TOUCHES,
    gate="DSV4FLASH_MBRIDGE_DEEPSEEK_V41",
    tests=("tests/patches/test_mbridge_deepseek_v41.py",),
    # The patch's `Depends-On: DSV41-MBRIDGE-002, DSV41-MBRIDGE-003, megatron-lm/DSV41-MCORE-006, -011`: FP8 block
    # size, row-chunked reads (Engram tables), megatron-core's host row-lookup table (Engram tables) and CSA2 / mHC
    # modules with layer kind C and YaRN (on a stock megatron-core, their twins).
    depends_on=("DSV41-MBRIDGE-002", "DSV41-MBRIDGE-003", "DSV41-MCORE-006", "DSV41-MCORE-011"),
    upstream_has_it=upstream_has_deepseek_v41,
)
def install(patcher: Patcher) -> None:
    """Provide `megatron.bridge.models.deepseek_v41` from the patch's files (registers the bridge)."""
    root = UPSTREAM_SOURCES / FOLDER
    package_spec, package = _load(patcher, PACKAGE, root / "__init__.py", package=True)
    for leaf in SUBMODULES:
        spec, module = _load(patcher, f"{PACKAGE}.{leaf}", root / f"{leaf}.py")
        spec.loader.exec_module(module)
    package_spec.loader.exec_module(package)
