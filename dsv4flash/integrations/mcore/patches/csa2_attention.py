"""Runtime twin of DSV41-MCORE-008: CSA2 attention as megatron-core modules with ModuleSpecs, on mHC layers.

Why: megatron-core 0.19.x has no sparse attention over compressed keys picked by an indexer (its DSA variant
attends to selected tokens, with no compressor, no sliding window with a sink, no grouped low-rank output
projection), so a DeepSeek-V4.1-style decoder cannot be built from its specs.

How: the format-patch adds `megatron/core/transformer/experimental_attention_variant/csa2_layout.py`
(per-sequence token positions and compression-group tables), `.../csa2.py` (config, compressor, indexer with
candidate pool, CSA2 self-attention) and `megatron/core/models/gpt/csa2_layer_specs.py` (CSA2 in the mHC layer
of DSV41-MCORE-010). The very same files ship in this package under `_upstream/` (tests check they are
byte-identical to the patched tree), and this twin executes them as those upstream modules on a stock install.
They import only megatron-core; the layer state crosses full recompute through DSV41-MCORE-007.

`csa2.py` ships as DSV41-MCORE-011 leaves it (layer kind `C`, YaRN fields): one runtime copy of the new
modules, not one per patch. A pattern without `C` and `csa2_yarn_factor` 1.0 (the defaults) build exactly the
modules of this patch alone; 011's twin checks the shipped file carries it.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin, provide_upstream_files, upstream_ships

# Upstream module -> its file under UPSTREAM_SOURCES (= its path in the Megatron-LM repository), in import order.
MODULES = {
    "megatron.core.transformer.experimental_attention_variant.csa2_layout":
        "megatron/core/transformer/experimental_attention_variant/csa2_layout.py",
    "megatron.core.transformer.experimental_attention_variant.csa2":
        "megatron/core/transformer/experimental_attention_variant/csa2.py",
    "megatron.core.models.gpt.csa2_layer_specs": "megatron/core/models/gpt/csa2_layer_specs.py",
}
# The patch whose patched tree `_upstream/` holds these files from (the last CSA2 patch that edits them).
SHIPPED_AS_OF = "DSV41-MCORE-011"
TOUCHES = (
    "megatron.core.transformer.experimental_attention_variant.csa2.CSA2SelfAttention",
    "megatron.core.models.gpt.csa2_layer_specs.get_csa2_decoder_block_spec",
)


def upstream_has_csa2() -> bool:
    """Probe: does the installed megatron-core ship the CSA2 attention (not this twin's)?"""
    return upstream_ships(MODULES)


@mcore_twin(
    patch_id="DSV41-MCORE-008",
    versions=">=0.19.0,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_CSA2_ATTENTION",
    tests=("tests/patches/test_mcore_csa2_attention.py",),
    depends_on=("DSV41-MCORE-010",),
    upstream_has_it=upstream_has_csa2,
)
def install(patcher: Patcher) -> None:
    """Provide the three upstream modules from the patch's own files."""
    provide_upstream_files(patcher, MODULES)
