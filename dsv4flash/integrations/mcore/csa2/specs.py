"""ModuleSpecs of the V4.1 stack: one `CSA2TransformerLayer` spec per layer plan, and the block spec.

Two backends, chosen like megatron-core's own `transformer_impl`:

- `"local"`: megatron-core's `ColumnParallelLinear` / `RowParallelLinear`, the fp32 release RMSNorm and
  `SequentialMLP` experts. Runs anywhere, CPU included.
- `"transformer_engine"`: `TEColumnParallelLinear` / `TERowParallelLinear` / `TELinear` (duplicated),
  `TENorm`, and `TEGroupedMLP` experts (grouped GEMM) when `moe_grouped_gemm=True`. The fused router is the
  config switch `moe_router_fusion=True` (sqrtsoftplus needs TE ≥ 2.13); the provider sets it. GPU only.

The MoE sublayer is megatron-core's `MoELayer` made padding- and modality-aware (`ModalityMoELayer` routed by
`ModalityTopKRouter`, `dsv4flash.integrations.mcore.router`). Engram layers get an `engram` submodule; the
default is the plain lookup (`CSA2Engram`); pass `engram=` to use another implementation (e.g. host-pinned).
"""

from __future__ import annotations

from typing import Any, Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.hyper_connection import HyperConnection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from dsv4flash.integrations.mcore.csa2.attention import CSA2AttentionSubmodules, CSA2SelfAttention
from dsv4flash.integrations.mcore.csa2.compressor import CompressorSubmodules, CSA2Compressor
from dsv4flash.integrations.mcore.csa2.indexer import CSA2Indexer, IndexerSubmodules
from dsv4flash.integrations.mcore.csa2.layer import CSA2Engram, CSA2LayerSubmodules, CSA2TransformerLayer
from dsv4flash.integrations.mcore.csa2.modules import CSA2RMSNorm

__all__ = ["BACKENDS", "backend_modules", "get_csa2_layer_spec", "get_csa2_block_spec"]

BACKENDS = ("local", "transformer_engine")


def backend_modules(backend: str) -> dict[str, Any]:
    """The linear / norm classes and the megatron-core backend provider of a backend name."""
    if backend == "local":
        return dict(column=ColumnParallelLinear, row=RowParallelLinear, replicated=ColumnParallelLinear,
                    norm=CSA2RMSNorm, provider=LocalSpecProvider())
    if backend == "transformer_engine":
        from megatron.core.extensions.transformer_engine import (
            HAVE_TE,
            TEColumnParallelLinear,
            TELinear,
            TENorm,
            TERowParallelLinear,
        )
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        if not HAVE_TE:
            raise ImportError("backend='transformer_engine' needs Transformer Engine (GPU); use backend='local'")
        return dict(column=TEColumnParallelLinear, row=TERowParallelLinear, replicated=TELinear, norm=TENorm,
                    provider=TESpecProvider())
    raise ValueError(f"unknown CSA2 backend {backend!r} (expected one of {BACKENDS})")


def _moe_spec(num_experts: int, provider: Any, moe_grouped_gemm: bool) -> Any:
    from dsv4flash.integrations.mcore.router import with_modality_routing

    stock = get_moe_module_spec_for_backend(backend=provider, num_experts=num_experts,
                                            moe_grouped_gemm=moe_grouped_gemm)
    return with_modality_routing(stock)


def get_csa2_layer_spec(config: Any, layer_id: int, *, backend: str = "local", moe_grouped_gemm: bool = False,
                        engram: Optional[Any] = None) -> ModuleSpec:
    """Spec of backbone layer `layer_id` (0-based) of `config.dsv4` (a `CSA2TransformerConfig`)."""
    plan = config.dsv4.backbone_plan[layer_id]
    mods = backend_modules(backend)
    norm = mods["norm"]
    compressor = indexer = None
    if plan.has_compressor:
        compressor = ModuleSpec(module=CSA2Compressor,
                                submodules=CompressorSubmodules(linear=mods["replicated"], norm=norm))
    if plan.has_indexer:
        indexer = ModuleSpec(module=CSA2Indexer, submodules=IndexerSubmodules(linear=mods["replicated"], norm=norm))
    attention = ModuleSpec(
        module=CSA2SelfAttention,
        submodules=CSA2AttentionSubmodules(column_linear=mods["column"], row_linear=mods["row"],
                                           replicated_linear=mods["replicated"], norm=norm,
                                           compressor=compressor, indexer=indexer),
    )
    return ModuleSpec(
        module=CSA2TransformerLayer,
        submodules=CSA2LayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            pre_mlp_layernorm=norm,
            mlp=_moe_spec(config.num_moe_experts, mods["provider"], moe_grouped_gemm),
            self_attn_hyper_connection=HyperConnection,
            mlp_hyper_connection=HyperConnection,
            engram=(engram or CSA2Engram) if plan.has_engram else None,
        ),
    )


def get_csa2_block_spec(config: Any, *, backend: str = "local", moe_grouped_gemm: Optional[bool] = None,
                        engram: Optional[Any] = None, vp_stage: Optional[int] = None,
                        pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """Per-layer specs of this pipeline stage's layers (all at PP = 1) and the final norm, for
    `CSA2TransformerBlock(config, spec)`; the split is megatron-core's (`get_transformer_layer_offset`,
    `get_num_layers_to_build`: even, first/last-stage counts or `pipeline_model_parallel_layout`)."""
    grouped = config.moe_grouped_gemm if moe_grouped_gemm is None else moe_grouped_gemm
    first, count = 0, config.num_layers
    if config.pipeline_model_parallel_size > 1:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        first = get_transformer_layer_offset(config, vp_stage, pp_rank)
        count = get_num_layers_to_build(config, vp_stage, pp_rank)
    layers = [get_csa2_layer_spec(config, i, backend=backend, moe_grouped_gemm=grouped, engram=engram)
              for i in range(first, first + count)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=backend_modules(backend)["norm"])
