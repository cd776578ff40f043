"""Runtime twin of DSV41-MCORE-009: CSA2 attention on THD-packed sequences and under context parallelism.

Why: with DSV41-MCORE-008 alone CSA2 attention takes one whole sequence per row: it refuses
`packed_seq_params` and `context_parallel_size > 1`. Packed training batches would otherwise let windows,
compression groups and top-k selections reach across documents, and a context-parallel shard would miss the
window keys and group members held by the previous rank and see only its own compressed keys.

How: the format-patch adds `megatron/core/transformer/experimental_attention_variant/csa2_context_parallel.py`
(THD slots from `cu_seqlens_q[_padded]`, megatron-core's zigzag split per row or per document, a halo
all-gather of the earlier tokens each span needs, compressed keys summed over ranks from their single
owner, both with the matching backward) and changes only `CSA2SelfAttention.token_layout` to build that
layout. This twin provides the new module from the patch's own file (`_upstream/`, byte-identical) and
replaces `token_layout` with the patched method below.
"""

from __future__ import annotations

import importlib

from dsv4flash.patching.twins import MARKER, Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin, provide_upstream_files

CSA2 = "megatron.core.transformer.experimental_attention_variant.csa2"
MODULE = "megatron.core.transformer.experimental_attention_variant.csa2_context_parallel"
SOURCE = "megatron/core/transformer/experimental_attention_variant/csa2_context_parallel.py"
TOUCHES = (f"{CSA2}.CSA2SelfAttention.token_layout", f"{MODULE}.build_csa2_layout")


def token_layout(self, hidden_states, packed_seq_params=None):
    """Where the tokens of hidden_states [s, b, h] sit: whole rows or THD-packed sequences, or
    this rank's share of them under context parallelism."""
    from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import (
        build_csa2_layout,
    )

    config = self.config
    cp_group = self.pg_collection.cp if config.context_parallel_size > 1 else None
    halo = max([config.csa2_sliding_window, *config.csa2_compress_ratios]) - 1
    s, b = hidden_states.shape[:2]
    return build_csa2_layout(b, s, hidden_states.device, halo, packed_seq_params, cp_group)


def upstream_has_csa2_packing_cp() -> bool:
    """Probe: does the installed CSA2 attention build its layout with the THD / context-parallel builder?"""
    try:
        module = importlib.import_module(MODULE)
        csa2 = importlib.import_module(CSA2)
    except ImportError:
        return False
    return not getattr(module, MARKER, None) and hasattr(csa2, "build_csa2_layout")


@mcore_twin(
    patch_id="DSV41-MCORE-009",
    versions=">=0.19.0,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_CSA2_PACKING_CP",
    tests=("tests/patches/test_mcore_csa2_packing_cp.py",),
    depends_on=("DSV41-MCORE-008",),
    upstream_has_it=upstream_has_csa2_packing_cp,
)
def install(patcher: Patcher) -> None:
    """Provide csa2_context_parallel from the patch's file and route token_layout through it."""
    provide_upstream_files(patcher, {MODULE: SOURCE})
    patcher.replace(importlib.import_module(CSA2).CSA2SelfAttention, "token_layout", token_layout)
