"""Megatron-Bridge param mappings generated from the bridge's name table (`dsv4flash_bridge.mapping`).

Nothing here names a tensor: every mapping is one `Rule` of the table, turned into the Megatron-Bridge class
its `layout`/`transform` calls for. The only additions are aliases the table's wildcard policy cannot spell:
Transformer Engine grouped-GEMM experts hold expert e of `…local_experts.{e}.linear_fc1.weight` as
`…experts.linear_fc1.weight{e}` (Megatron-Bridge writes that pattern `weight*`).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.param_mapping import (ColumnParallelMapping, ConcatenatedQKVMapping,
                                                              GatedMLPMapping, MegatronParamMapping,
                                                              ReplicatedMapping, RowParallelMapping)

from dsv4flash_bridge.mapping import RULES, Rule

__all__ = ["FusedGatedMLPMapping", "ReplicatedStateMapping", "mappings_for", "build_registry"]



class ReplicatedStateMapping(ReplicatedMapping):
    """`ReplicatedMapping` that also serves a module holding only buffers (the router's image-balance expert
    bias lives in a parameter-less module; Megatron-Bridge's version looks for a parameter to find the device)."""

    def hf_to_megatron(self, hf_weights: torch.Tensor, megatron_module: torch.nn.Module) -> torch.Tensor:
        """Replicate to every tensor-parallel rank, on the device of the module's tensors."""
        if hasattr(megatron_module, "weight") or next(megatron_module.parameters(), None) is not None:
            return super().hf_to_megatron(hf_weights, megatron_module)
        buffer = next(megatron_module.buffers(), None)
        hf_weights = hf_weights.to(device=buffer.device if buffer is not None else "cpu")
        if self.tp_size == 1:
            return hf_weights
        if self.tp_rank > 0:
            hf_weights = torch.empty_like(hf_weights)
        return self.broadcast_tensor_to_tp_ranks(hf_weights, src_rank=0)


_BY_LAYOUT = {"copy": ReplicatedStateMapping, "rows": ColumnParallelMapping, "cols": RowParallelMapping}


class FusedGatedMLPMapping(GatedMLPMapping):
    """A checkpoint tensor that already is [gate ; up] (the ViT's `mlp.w1`) <-> Megatron `linear_fc1`, with
    the gated-MLP tensor-parallel split (each half split along dim 0, rank i holds [gate_i ; up_i])."""

    def __init__(self, megatron_param: str, hf_param: str) -> None:
        MegatronParamMapping.__init__(self, megatron_param, hf_param)

    def resolve(self, captures):
        """Wildcards filled in (one checkpoint name, not GatedMLPMapping's gate/up pair)."""
        return MegatronParamMapping.resolve(self, captures)

    def hf_to_megatron(self, hf_weights: torch.Tensor, megatron_module: torch.nn.Module) -> torch.Tensor:
        """[gate ; up] -> this rank's [gate_i ; up_i]."""
        gate, up = hf_weights.chunk(2, dim=0)
        return super().hf_to_megatron({"gate": gate, "up": up}, megatron_module)

    def megatron_to_hf(self, megatron_weights: Optional[torch.Tensor],
                       megatron_module: Optional[torch.nn.Module]) -> Dict[str, torch.Tensor]:
        """Every rank's [gate_i ; up_i] -> the full [gate ; up]."""
        megatron_weights = self.broadcast_from_pp_rank(megatron_weights, cache_key=str(self.hf_param))
        if megatron_weights is None:
            return {}
        megatron_weights = self.maybe_dequantize(megatron_weights)
        shards = [megatron_weights] if self.tp_size == 1 else self.gather_from_tp_ranks(megatron_weights)
        gates, ups = zip(*(shard.chunk(2, dim=0) for shard in shards))
        return {self.hf_param: torch.cat([*gates, *ups], dim=0)}


def _grouped_expert_alias(pattern: str) -> Optional[str]:
    """`…local_experts.*.linear_fcN.weight` -> `…experts.linear_fcN.weight*` (TE grouped GEMM), else None."""
    head, sep, tail = pattern.partition("experts.local_experts.*.")
    return f"{head}experts.{tail}*" if sep else None


def mappings_for(rule: Rule) -> list[MegatronParamMapping]:
    """The Megatron-Bridge mapping(s) of one table rule (the rule itself, plus a grouped-GEMM alias)."""
    out = []
    for megatron in filter(None, (rule.megatron, _grouped_expert_alias(rule.megatron))):
        if rule.transform == "qkv":
            out.append(ConcatenatedQKVMapping(megatron, rule.release[0]))
        elif rule.layout == "glu" and len(rule.release) == 2:
            out.append(GatedMLPMapping(megatron_param=megatron, gate=rule.release[0], up=rule.release[1]))
        elif rule.layout == "glu":
            out.append(FusedGatedMLPMapping(megatron, rule.release[0]))
        else:
            out.append(_BY_LAYOUT[rule.layout](megatron, rule.release[0]))
    return out


def build_registry(parts: tuple[str, ...] = ("text", "vision", "mtp")) -> MegatronMappingRegistry:
    """A `MegatronMappingRegistry` over every rule of the table in `parts`."""
    return MegatronMappingRegistry(*(m for rule in RULES if rule.part in parts for m in mappings_for(rule)))
