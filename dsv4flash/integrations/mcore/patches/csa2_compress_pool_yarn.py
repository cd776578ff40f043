"""Runtime twin of DSV41-MCORE-011: CSA2 layer kind `C` (compress keys and build the candidate pool) and YaRN
on the layers that read compressed keys.

Why: DSV41-MCORE-008's `csa2_layer_pattern` has `F` (owns the compressor and index keys, no pool) and `P`
(pool, no compressor or `linear_k`), so DeepSeek-V4.1's first decoder layer (ratio-1 compressor without a
gate, its own index keys, the candidate pool the re-indexing layers read) has no Megatron parameters to load
into, and compressed layers rotate with plain RoPE where the release uses YaRN frequency interpolation.

How: the format-patch changes `csa2.py` only (kind `C`; config fields `csa2_yarn_factor`,
`csa2_yarn_original_max_position_embeddings`, `csa2_yarn_beta_fast`, `csa2_yarn_beta_slow`;
`rope_frequencies`). CSA2 is a set of new upstream modules, so there is one runtime copy of them: the files
under `_upstream/` are byte-identical to the patched tree of this patch (008 then 011), and the twin of
DSV41-MCORE-008 executes them. With a pattern without `C` and `csa2_yarn_factor` 1.0 (the defaults) they
behave exactly as 008 alone, which the 008 tests check. This twin therefore only confirms, when applied, that
the CSA2 module in use carries this change; it refuses (one line) a megatron-core that ships CSA2 itself but
not this change, since a twin cannot add fields to an upstream dataclass without shadowing it.
"""

from __future__ import annotations

import dataclasses
import importlib

from dsv4flash.patching.twins import MARKER, Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin

CSA2 = "megatron.core.transformer.experimental_attention_variant.csa2"
YARN_FIELDS = ("csa2_yarn_factor", "csa2_yarn_original_max_position_embeddings", "csa2_yarn_beta_fast",
               "csa2_yarn_beta_slow")
TOUCHES = (f"{CSA2}.CSA2TransformerConfig", f"{CSA2}.csa2_layer_role", f"{CSA2}.rope_frequencies",
           f"{CSA2}.CSA2SelfAttention")


def carries_compress_pool_yarn(module) -> bool:
    """Whether a loaded csa2 module has layer kind C and the four YaRN config fields."""
    fields = {f.name for f in dataclasses.fields(module.CSA2TransformerConfig)}
    return "C" in module.LAYER_KINDS and set(YARN_FIELDS) <= fields and hasattr(module, "rope_frequencies")


def upstream_has_compress_pool_yarn() -> bool:
    """Probe: does the installed megatron-core's own CSA2 (not a twin's files) have kind C and YaRN?"""
    try:
        module = importlib.import_module(CSA2)
    except ImportError:
        return False
    return not getattr(module, MARKER, None) and carries_compress_pool_yarn(module)


@mcore_twin(
    patch_id="DSV41-MCORE-011",
    versions=">=0.19.0,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_CSA2_COMPRESS_POOL_YARN",
    tests=("tests/patches/test_mcore_csa2_compress_pool_yarn.py",),
    depends_on=("DSV41-MCORE-008",),
    upstream_has_it=upstream_has_compress_pool_yarn,
)
def install(patcher: Patcher) -> None:
    """Check that the CSA2 module provided by DSV41-MCORE-008's twin (the shared `_upstream/` files) has 011."""
    module = importlib.import_module(CSA2)
    if not carries_compress_pool_yarn(module):
        origin = "the installed megatron-core" if not getattr(module, MARKER, None) else "the shipped _upstream/"
        raise RuntimeError(f"DSV41-MCORE-011: {CSA2} from {origin} has no layer kind C or no "
                           f"{'/'.join(YARN_FIELDS)} fields; install a megatron-core with the patch applied "
                           "(dsv4flash patches apply)")
