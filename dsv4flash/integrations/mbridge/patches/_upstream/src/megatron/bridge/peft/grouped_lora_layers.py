# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""LoRA for grouped low-rank projections: one adapter per group, no cross-group terms.

A grouped low-rank projection (megatron-core's ``GroupedLowRankProjection`` of CSA2 attention) maps
o [b, s, G, d_in] to z [b, s, G * d_out] with one weight block W_g [d_out, d_in] per group, stored
group-major as weight [G * d_out, d_in]. A LoRA over the flattened input would mix the groups; here
group g gets its own update

    z_g += (alpha / dim) * B_g A_g o_g,    A_g [dim, d_in], B_g [d_out, dim].

In the HF/PEFT layout the same adapter is one LoRA of rank G * dim on the base weight:
lora_A = [A_0; ...; A_{G-1}] [G * dim, d_in] and a block-diagonal lora_B [G * d_out, G * dim], so
lora_B @ lora_A stacks B_g A_g like the base weight. PEFT scales by lora_alpha / r, so the export
states r = G * dim and lora_alpha = G * alpha to keep the scaling alpha / dim.

Tensor parallelism gives each rank whole groups (partition dim 0), like the base weight.
"""

import math
from typing import Dict, Optional

import torch
import torch.nn as nn
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


class GroupedLoRAAdapter(nn.Module):
    """Per-group LoRA factors: lora_A [G, dim, d_in], lora_B [G, d_out, dim] (B starts at zero)."""

    def __init__(
        self,
        groups: int,
        in_per_group: int,
        out_per_group: int,
        dim: int,
        alpha: float,
        dropout: float = 0.0,
        lora_A_init_method: str = "xavier",
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if lora_A_init_method not in ("xavier", "normal", "kaiming"):
            raise ValueError(
                f"GroupedLoRAAdapter: lora_A_init_method must be 'xavier', 'normal' or 'kaiming', "
                f"got {lora_A_init_method!r}"
            )
        self.groups, self.dim, self.alpha = groups, dim, alpha
        self.lora_A = nn.Parameter(torch.empty(groups, dim, in_per_group, dtype=params_dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(groups, out_per_group, dim, dtype=params_dtype, device=device))
        for group_a in self.lora_A.data.unbind(0):  # each A_g initialised as LoRA's linear_in would be
            if lora_A_init_method == "xavier":
                nn.init.xavier_normal_(group_a)
            elif lora_A_init_method == "normal":
                nn.init.normal_(group_a, mean=0.0, std=0.2)
            else:
                nn.init.kaiming_uniform_(group_a, a=math.sqrt(5))
        for param in (self.lora_A, self.lora_B):
            setattr(param, "tensor_model_parallel", True)
            setattr(param, "partition_dim", 0)
            setattr(param, "partition_stride", 1)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def scaling(self) -> float:
        """alpha / dim."""
        return self.alpha / self.dim

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o [b, s, G, d_in] -> (alpha / dim) * B_g A_g o_g, flattened to [b, s, G * d_out]."""
        low = torch.einsum("bsgd,grd->bsgr", self.dropout(o), self.lora_A.to(o.dtype))  # [b, s, G, dim]
        out = torch.einsum("bsgr,gor->bsgo", low, self.lora_B.to(o.dtype))  # [b, s, G, d_out]
        return out.flatten(-2) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """The update of the base weight, group-major like it: [G * d_out, d_in]."""
        return torch.bmm(self.lora_B, self.lora_A).flatten(0, 1) * self.scaling


class LoRAGroupedLowRankProjection(nn.Module):
    """A grouped low-rank projection plus its per-group LoRA: o [b, s, G, d_in] -> [b, s, G * d_out].

    The base module stays reachable as ``to_wrap`` (so its weight keeps its name plus ``.to_wrap``, as
    with ``LoRALinear``) and the factors live under ``adapter``.
    """

    def __init__(self, to_wrap: nn.Module, adapter: GroupedLoRAAdapter) -> None:
        super().__init__()
        self.to_wrap = to_wrap
        self.adapter = adapter
        self._adapter_enabled = True

    def enable_adapter_layers(self) -> None:
        """Add the adapter's update again."""
        self._adapter_enabled = True

    def disable_adapter_layers(self) -> None:
        """Run the base projection alone."""
        self._adapter_enabled = False

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """Base grouped projection + (alpha / dim) * B_g A_g o_g per group."""
        out = self.to_wrap(o)  # [b, s, G * d_out]
        if not self._adapter_enabled:
            return out
        return out + self.adapter(o).to(out.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The effective base weight [G * d_out, d_in], including the update when the adapter is enabled."""
        base = self.to_wrap.weight
        if not self._adapter_enabled:
            return base
        return (base.float() + self.adapter.delta_weight().float()).to(base.dtype)

    def peft_weights(self) -> Dict[str, object]:
        """This rank's adapter in the HF/PEFT layout: rank-(G * dim) ``lora_A.weight`` and block-diagonal
        ``lora_B.weight``, with the ``r`` and ``lora_alpha`` that keep the scaling alpha / dim."""
        groups = self.adapter.groups
        lora_a = self.adapter.lora_A.detach().flatten(0, 1)  # [G * dim, d_in]
        lora_b = torch.block_diag(*self.adapter.lora_B.detach().unbind(0))  # [G * d_out, G * dim]
        return {
            "lora_A.weight": lora_a,
            "lora_B.weight": lora_b,
            "r": groups * self.adapter.dim,
            "lora_alpha": groups * self.adapter.alpha,
        }

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ):
        """The base as before; the per-group factors split over tensor parallelism along the group dim."""
        sharded = self.to_wrap.sharded_state_dict(f"{prefix}to_wrap.", sharded_offsets, metadata)
        adapter_state = self.adapter.state_dict(prefix="", keep_vars=True)
        sharded.update(
            make_sharded_tensors_for_checkpoint(
                adapter_state, f"{prefix}adapter.", {"lora_A": 0, "lora_B": 0}, sharded_offsets
            )
        )
        return sharded


def grouped_low_rank_projection_type() -> Optional[type]:
    """megatron-core's ``GroupedLowRankProjection``, or None when the installed megatron-core has none."""
    try:
        from megatron.core.transformer.experimental_attention_variant.csa2 import GroupedLowRankProjection
    except ImportError:
        return None
    return GroupedLowRankProjection
