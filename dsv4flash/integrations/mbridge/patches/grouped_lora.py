"""Runtime twin of DSV41-MBRIDGE-004: Megatron-Bridge's LoRA on megatron-core's grouped low-rank projection.

Why: megatron-bridge 0.6.2's `LoRA.transform` sends every matched module that is not an `nn.Linear` to
`get_adapter_attributes_from_linear`, which raises "Layer type is unrecognized for LoRA" for the CSA2
attention's `GroupedLowRankProjection` (DSV41-MCORE-008); a linear LoRA over the concatenated groups would add
cross-group terms anyway.

How: the patch's new module `megatron.bridge.peft.grouped_lora_layers` (`GroupedLoRAAdapter`,
`LoRAGroupedLowRankProjection`, `grouped_low_rank_projection_type`) is executed from the patch's own file
(`_upstream/`, byte-identical); `LoRA.transform` wraps a matched grouped projection as the patch's hunk does
and otherwise runs the stock method. The project's own `DSV41LoRA` (`integrations/mbridge/grouped_lora.py`)
wraps the project's `GroupedOutputProjection` and is unaffected.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from dsv4flash.patching.twins import MARKER, Patcher
from dsv4flash.integrations.mbridge.patches import import_bridge, mbridge_twin
from dsv4flash.integrations.mcore.patches import provide_upstream_files

UPSTREAM_SOURCES = Path(__file__).resolve().parent / "_upstream"
MODULE = "megatron.bridge.peft.grouped_lora_layers"
SOURCE = "src/megatron/bridge/peft/grouped_lora_layers.py"
TOUCHES = ("megatron.bridge.peft.lora.LoRA.transform",) + tuple(
    f"{MODULE}.{name}" for name in ("GroupedLoRAAdapter", "LoRAGroupedLowRankProjection",
                                    "grouped_low_rank_projection_type"))


def upstream_has_grouped_lora() -> bool:
    """Probe: does the installed megatron-bridge ship `peft.grouped_lora_layers` (not this twin's)?"""
    import_bridge()
    if MODULE in sys.modules:
        return not getattr(sys.modules[MODULE], MARKER, None)
    return importlib.util.find_spec(MODULE) is not None


def _transform(gl, stock):
    """`LoRA.transform` that wraps a matched grouped low-rank projection, as the patch's hunk does."""

    def transform(self, module, name=None, prefix=None):
        """Stock `LoRA.transform`; a matched `GroupedLowRankProjection` gets one adapter per group."""
        if isinstance(module, gl.LoRAGroupedLowRankProjection):
            return module
        grouped_type = gl.grouped_low_rank_projection_type()
        if grouped_type is not None and isinstance(module, grouped_type) and (
                self.match(module, name, prefix) is not None):
            weight = module.weight
            adapter = gl.GroupedLoRAAdapter(module.groups, module.in_per_group, module.rank, dim=self.dim,
                                            alpha=self.alpha, dropout=self.dropout,
                                            lora_A_init_method=self.lora_A_init_method,
                                            params_dtype=self.lora_dtype or weight.dtype, device=weight.device)
            return gl.LoRAGroupedLowRankProjection(module, adapter)
        return stock(self, module, name, prefix)

    return transform


@mbridge_twin(
    patch_id="DSV41-MBRIDGE-004",
    touches=TOUCHES,
    gate="DSV4FLASH_MBRIDGE_GROUPED_LORA",
    tests=("tests/patches/test_mbridge_grouped_lora.py",),
    depends_on=("DSV41-MCORE-008",),  # the patch's `Depends-On: megatron-lm/DSV41-MCORE-008`: the projection it wraps
    upstream_has_it=upstream_has_grouped_lora,
)
def install(patcher: Patcher) -> None:
    """Provide `peft.grouped_lora_layers` and wrap `LoRA.transform`."""
    from megatron.bridge.peft.lora import LoRA

    provide_upstream_files(patcher, {MODULE: SOURCE}, root=UPSTREAM_SOURCES)
    patcher.replace(LoRA, "transform", _transform(sys.modules[MODULE], LoRA.transform))
