"""Block-diagonal LoRA on the grouped output projection (`linear_o_group_proj`, release `wo_a`) in Megatron.

Megatron-Bridge's LoRA cannot wrap `linear_o_group_proj`: it is a grouped einsum, not a linear, and a generic
adapter over the concatenated input would add G×G cross-group terms (docs/architecture.md §3). `DSV41LoRA` is
Megatron-Bridge's `LoRA` that additionally wraps every matching `GroupedOutputProjection` in a
`GroupedLoRAProjection`: group g gets its own update, z_g += scaling · B_g (A_g o_g), i.e. ΔW rows
g·o_lora_rank … (g+1)·o_lora_rank − 1 are B_g·A_g (`dsv4flash.lora.functional`, the reference's math).

Names follow Megatron-Bridge's wrappers: the base stays reachable as `…linear_o_group_proj.to_wrap.weight`
(so base conversion and the name table keep working), the factors live under `…adapter.` (so base export
skips them): `adapter.lora_A` [G_local, r, in_g] and `adapter.lora_B` [G_local, out_g, r], or with
`wo_a_lora="shared_a"` one `lora_A` [r, in_g] shared by every group and `lora_B` [G_local·out_g, r].
Tensor parallelism splits whole groups, like the base weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.bridge.peft.lora import LoRA
from torch import nn

from dsv4flash.integrations.mcore.csa2.modules import GroupedOutputProjection
from dsv4flash.lora.functional import grouped_lora_delta, grouped_lora_forward

__all__ = ["GroupedLoRAAdapter", "GroupedLoRAProjection", "DSV41LoRA", "grouped_adapters"]

WO_A_MODES = ("per_group", "shared_a")
VISION_PREFIXES = ("vision_model.", "vision_projection.")


class GroupedLoRAAdapter(nn.Module):
    """The factors of one grouped adapter (B starts at zero, so a fresh adapter changes nothing)."""

    def __init__(self, groups: int, in_per_group: int, out_per_group: int, rank: int, alpha: float, mode: str,
                 dtype: torch.dtype, device=None) -> None:
        super().__init__()
        if mode not in WO_A_MODES:
            raise ValueError(f"grouped LoRA mode must be one of {WO_A_MODES}, got {mode!r}")
        self.rank, self.alpha, self.mode, self.groups = rank, alpha, mode, groups
        a_shape = (groups, rank, in_per_group) if mode == "per_group" else (rank, in_per_group)
        b_shape = (groups, out_per_group, rank) if mode == "per_group" else (groups * out_per_group, rank)
        bound = 1.0 / math.sqrt(in_per_group)  # PEFT's Kaiming-uniform(a=√5) bound
        self.lora_A = nn.Parameter(torch.empty(a_shape, dtype=dtype, device=device).uniform_(-bound, bound))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))

    @property
    def scaling(self) -> float:
        """alpha / rank."""
        return float(self.alpha) / self.rank


class GroupedLoRAProjection(nn.Module):
    """`linear_o_group_proj` plus its block-diagonal update: o [B,S,G,in_g] -> [B,S,G·out_g]."""

    def __init__(self, to_wrap: GroupedOutputProjection, rank: int, alpha: float, mode: str = "per_group") -> None:
        super().__init__()
        self.to_wrap = to_wrap
        # out per group = the release's o_lora_rank (`to_wrap.rank`, the base projection's width), not the LoRA rank
        self.adapter = GroupedLoRAAdapter(to_wrap.local_groups, to_wrap.in_per_group, to_wrap.rank, rank, alpha, mode,
                                          torch.float32, to_wrap.weight.device)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """Base grouped projection + scaling · B_g(A_g o_g) per group."""
        out = self.to_wrap(o)  # [B,S,G·out_g]
        a, b = self.adapter.lora_A, self.adapter.lora_B
        return out + grouped_lora_forward(o, a, b, self.adapter.scaling).to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """This rank's ΔW in the base weight's group-major layout [G_local·out_g, in_g] (fp32)."""
        return grouped_lora_delta(self.adapter.lora_A, self.adapter.lora_B, self.adapter.scaling,
                                  self.adapter.groups)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Distributed checkpoint: the base as before, the per-group factors split over TP along dim 0."""
        from dsv4flash.integrations.mcore.csa2.modules import sharded_state_dict_with_tp_axes

        out = self.to_wrap.sharded_state_dict(f"{prefix}to_wrap.", sharded_offsets, metadata)
        axes = {"lora_A": 0, "lora_B": 0} if self.adapter.mode == "per_group" else {"lora_B": 0}
        out.update(sharded_state_dict_with_tp_axes(self.adapter, axes, f"{prefix}adapter.", sharded_offsets, metadata))
        return out


@dataclass
class DSV41LoRA(LoRA):
    """Megatron-Bridge `LoRA` that also adapts `linear_o_group_proj` block-diagonally (target it by name).

    The ViT's layers are named like the language model's (`vision_model.decoder.layers.*.self_attention.
    linear_proj`), so a pattern such as `*.layers.*.linear_proj` matches both; `adapt_vision=False` (the
    plugin's `vit="frozen"`) keeps adapters off the ViT and aligner whatever the patterns say.
    """

    wo_a_lora: str = "per_group"
    adapt_vision: bool = False

    def transform(self, module: nn.Module, name: Optional[str] = None, prefix: Optional[str] = None) -> nn.Module:
        """Wrap a matching grouped projection; everything else is Megatron-Bridge's LoRA."""
        full = f"{prefix}.{name}" if prefix else (name or "")
        if not self.adapt_vision and full.removeprefix("module.").startswith(VISION_PREFIXES):
            return module
        if isinstance(module, GroupedOutputProjection):
            if self.match(module, name, prefix) is None:
                return module
            # `dim` is Megatron-Bridge's name of the LoRA rank (a field of its `LoRA`)
            return GroupedLoRAProjection(module, self.dim, self.alpha, self.wo_a_lora)
        return super().transform(module, name, prefix)


def grouped_adapters(model: nn.Module) -> dict[str, GroupedLoRAProjection]:
    """Module name -> grouped adapter wrapper, for every one in the model (names without `module.` wrappers)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedLoRAProjection):
            out[name.removeprefix("module.")] = module
    return out
