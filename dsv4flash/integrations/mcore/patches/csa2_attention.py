"""Runtime twin of DSV41-MCORE-008: CSA2 attention and the mHC layer as megatron-core modules with ModuleSpecs.

Why: megatron-core 0.19.x has neither sparse attention over compressed keys picked by an indexer (its DSA
variant attends to selected tokens, with no compressor, no sliding window with a sink, no grouped low-rank
output projection) nor hyper-connections, so a DeepSeek-V4.1-style decoder cannot be built from its specs.

How: the format-patch adds four files: `megatron/core/transformer/hyper_connection.py` (mHC config, the
coefficient module, `HyperConnectionTransformerLayer`), `megatron/core/transformer/experimental_attention_variant/
csa2_layout.py` (per-sequence token positions and compression-group tables), `.../csa2.py` (config, compressor,
indexer with candidate pool, CSA2 self-attention) and
`megatron/core/models/gpt/csa2_layer_specs.py`. The very same files ship in this package under `_upstream/`
(tests check they are byte-identical to the patch), and this twin executes them as those upstream modules on
a stock install. They import only megatron-core; the layer state crosses full recompute through
DSV41-MCORE-007.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from dsv4flash._patching import MARKER, Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin

SOURCE_ROOT = Path(__file__).resolve().parent / "_upstream"
# Upstream module -> its file under SOURCE_ROOT (= its path in the Megatron-LM repository), in import order.
MODULES = {
    "megatron.core.transformer.hyper_connection": "megatron/core/transformer/hyper_connection.py",
    "megatron.core.transformer.experimental_attention_variant.csa2_layout":
        "megatron/core/transformer/experimental_attention_variant/csa2_layout.py",
    "megatron.core.transformer.experimental_attention_variant.csa2":
        "megatron/core/transformer/experimental_attention_variant/csa2.py",
    "megatron.core.models.gpt.csa2_layer_specs": "megatron/core/models/gpt/csa2_layer_specs.py",
}
TOUCHES = (
    "megatron.core.transformer.hyper_connection.HyperConnectionTransformerLayer",
    "megatron.core.transformer.experimental_attention_variant.csa2.CSA2SelfAttention",
    "megatron.core.models.gpt.csa2_layer_specs.get_csa2_decoder_block_spec",
)


def upstream_has_csa2() -> bool:
    """Probe: does the installed megatron-core ship the CSA2 attention and the mHC layer (not this twin's)?"""
    try:
        modules = [importlib.import_module(name) for name in MODULES]
    except ImportError:
        return False
    return not any(getattr(m, MARKER, None) for m in modules)


@mcore_twin(
    patch_id="DSV41-MCORE-008",
    versions=">=0.19.0,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_CSA2_ATTENTION",
    tests=("tests/patches/test_mcore_csa2_attention.py",),
    depends_on=("DSV41-MCORE-007",),
    upstream_has_it=upstream_has_csa2,
)
def install(patcher: Patcher) -> None:
    """Provide the three upstream modules from the patch's own source files."""
    for name, rel in MODULES.items():
        spec = importlib.util.spec_from_file_location(name, SOURCE_ROOT / rel)
        module = importlib.util.module_from_spec(spec)
        patcher.provide_module(name, module)  # registered first: dataclasses look their module up
        spec.loader.exec_module(module)
