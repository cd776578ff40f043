"""Runtime twin of DSV41-MCORE-010: manifold-constrained hyper-connections (mHC) as a megatron-core layer.

Why: megatron-core 0.19.x's TransformerLayer keeps one residual stream (x + f(x)); a model whose layers read a
learned collapse of several residual streams and write back through a doubly stochastic mixing matrix (mHC, as
DeepSeek-V4 uses) cannot be built from its specs.

How: the format-patch adds `megatron/core/transformer/hyper_connection.py` (`HyperConnectionTransformerConfig`,
the per-site coefficient module `HyperConnection`, `HyperConnectionTransformerLayer`: streams packed as
[s, b, hc·h] between layers, the first layer expands the embeddings and the last collapses them, the next
site's collapse weights travel in the context slot through DSV41-MCORE-007) and
`megatron/core/models/gpt/hyper_connection_layer_specs.py` (the local GPT layer on streams). This twin
executes the patch's own files (`_upstream/`, byte-identical) as those modules on a stock install.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin, provide_upstream_files, upstream_ships

MODULES = {
    "megatron.core.transformer.hyper_connection": "megatron/core/transformer/hyper_connection.py",
    "megatron.core.models.gpt.hyper_connection_layer_specs": "megatron/core/models/gpt/hyper_connection_layer_specs.py",
}
TOUCHES = (
    "megatron.core.transformer.hyper_connection.HyperConnectionTransformerLayer",
    "megatron.core.models.gpt.hyper_connection_layer_specs.get_hyper_connection_layer_local_spec",
)


def upstream_has_hyper_connections() -> bool:
    """Probe: does the installed megatron-core ship the mHC layer (not this twin's)?"""
    return upstream_ships(MODULES)


@mcore_twin(
    patch_id="DSV41-MCORE-010",
    versions=">=0.19.0,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_HYPER_CONNECTION",
    tests=("tests/patches/test_mcore_hyper_connection.py",),
    depends_on=("DSV41-MCORE-007",),
    upstream_has_it=upstream_has_hyper_connections,
)
def install(patcher: Patcher) -> None:
    """Provide the two upstream modules from the patch's own files."""
    provide_upstream_files(patcher, MODULES)
