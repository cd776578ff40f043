"""Small Megatron building blocks of the CSA2 layers: the fp32 RMSNorm, linear builders, the grouped `wo_a`.

Linears are megatron-core's own parallel linears (so Megatron-Bridge LoRA can wrap them). Three placements:

- `column`: output split over tensor-parallel ranks (query heads);
- `row`: input split, output all-reduced (the output projection `wo_b`);
- `replicated`: every rank holds and computes the full projection (latents, compressor, indexer). Locally
  that is a `ColumnParallelLinear` with `gather_output=True`; with Transformer Engine a `TELinear` in
  `duplicated` mode.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.module import MegatronModule

from dsv4flash.integrations.mcore.csa2.config import with_dtype
from dsv4flash.model.norm import RMSNorm

__all__ = ["CSA2RMSNorm", "GroupedOutputProjection", "KeepFP32", "build_linear", "linear_forward",
           "sharded_state_dict_with_tp_axes"]


class CSA2RMSNorm(RMSNorm):
    """The release RMSNorm (fp32 compute, weight after normalisation) with megatron-core's norm signature."""

    def __init__(self, config: Any, hidden_size: int, eps: float | None = None, **_unused: Any) -> None:
        super().__init__(hidden_size, config.layernorm_epsilon if eps is None else eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", False)


def _is_te_linear(cls: Any) -> bool:
    return getattr(cls, "__name__", "") == "TELinear"


def build_linear(cls: Any, in_features: int, out_features: int, config: Any, placement: str, *,
                 name: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Instantiate a Megatron linear (no bias) for `placement` in {'column', 'row', 'replicated'}."""
    cfg = with_dtype(config, dtype) if dtype is not None else config
    common = dict(config=cfg, init_method=cfg.init_method, bias=False, skip_bias_add=False,
                  tp_comm_buffer_name=name)
    if placement == "row":
        common["init_method"] = cfg.output_layer_init_method
        return cls(in_features, out_features, input_is_parallel=True, is_expert=False, **common)
    if placement == "replicated" and _is_te_linear(cls):
        return cls(in_features, out_features, parallel_mode="duplicated", skip_weight_param_allocation=False,
                   tp_group=None, **common)
    if placement not in ("column", "replicated"):
        raise ValueError(f"unknown linear placement {placement!r}")
    if placement == "replicated" and not issubclass(cls, ColumnParallelLinear):
        raise ValueError(f"{cls.__name__} cannot hold a replicated projection ({name}); use ColumnParallelLinear "
                         "or TELinear")
    return cls(in_features, out_features, is_expert=False, gather_output=placement == "replicated", **common)


class KeepFP32:
    """Mixin for modules owning release fp32 islands (`_fp32_params`, dotted names allowed).

    megatron-core's `Float16Module` calls `.bfloat16()` / `.half()` on the whole model; these parameters are
    moved like any other but keep their exact fp32 values (mHC, sinks, the ratio > 1 compressor, the head).
    """

    _fp32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse: bool = True):  # noqa: D401 - torch hook
        """nn.Module._apply, then restore the fp32 islands from their pre-cast values."""
        islands = self._fp32_islands()
        saved = [(param, param.data) for param in islands if param.dtype == torch.float32]
        out = super()._apply(fn, recurse)
        for param, before in saved:
            if param.dtype != torch.float32 and not param.is_meta:
                param.data = before.to(device=param.device)
        for param in islands:  # an adapter created in params_dtype joins its island (an exact upcast)
            if param.is_floating_point() and param.dtype != torch.float32 and not param.is_meta:
                param.data = param.data.float()
        return out

    def _fp32_islands(self) -> list[torch.nn.Parameter]:
        """The `_fp32_params`, and the adapter of any adapter wrapper in their path: Megatron-Bridge's
        `LoRALinear` holds the linear as `to_wrap` (its `weight` property is the merged weight), and an
        adapter on an fp32 island sees the island's fp32 input, so it keeps fp32 too."""
        islands = []
        for name in self._fp32_params:
            owner, _, leaf = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            while leaf not in module._parameters and isinstance(getattr(module, "to_wrap", None), torch.nn.Module):
                adapter = getattr(module, "adapter", None)
                islands += list(adapter.parameters()) if isinstance(adapter, torch.nn.Module) else []
                module = module.to_wrap
            if module._parameters.get(leaf) is None:
                raise AttributeError(f"{type(self).__name__}: fp32 island {name!r} is not a parameter")
            islands.append(module._parameters[leaf])
        return islands


def sharded_state_dict_with_tp_axes(module: MegatronModule, axes: dict[str, int], prefix: str = "",
                                    sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
    """megatron-core's default `sharded_state_dict`, with this module's own tensors in `axes` TP-sharded."""
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
        sharded_state_dict_default,
    )

    state: dict = {}
    module._save_to_state_dict(state, "", keep_vars=True)
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    tp_group = getattr(module, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    out = make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=tp_group,
                                              dp_cp_group=metadata["dp_cp_group"])
    for name, child in module.named_children():
        out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=tp_group))
    return out


def linear_forward(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run a Megatron linear (which returns `(output, bias)`) and return the output."""
    out = linear(x)
    return out[0] if isinstance(out, tuple) else out


class GroupedOutputProjection(MegatronModule):
    """`wo_a` (release name) as `linear_o_group_proj`: z_g = W_g · o_g per output group (§3).

    weight [local_groups·rank, in_per_group], rows group-major; tensor parallelism gives each rank whole
    groups (partition dim 0), matching the head split of the query projection.
    """

    def __init__(self, config: Any, groups: int, in_per_group: int, rank: int) -> None:
        super().__init__(config)
        tp = config.tensor_model_parallel_size
        self.local_groups = divide(groups, tp)
        self.rank, self.in_per_group = rank, in_per_group
        self.weight = torch.nn.Parameter(torch.empty(self.local_groups * rank, in_per_group,
                                                     dtype=config.params_dtype))
        setattr(self.weight, "tensor_model_parallel", True)
        setattr(self.weight, "partition_dim", 0)
        setattr(self.weight, "partition_stride", 1)
        if config.perform_initialization:
            config.init_method(self.weight)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Distributed checkpoint: the weight is split over tensor-parallel ranks along dim 0 (groups)."""
        return sharded_state_dict_with_tp_axes(self, {"weight": 0}, prefix, sharded_offsets, metadata)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o: [B, S, local_groups, in_per_group] -> [B, S, local_groups·rank]."""
        w = self.weight.view(self.local_groups, self.rank, self.in_per_group)
        return torch.einsum("bsgd,grd->bsgr", o, w.to(o.dtype)).flatten(-2)
