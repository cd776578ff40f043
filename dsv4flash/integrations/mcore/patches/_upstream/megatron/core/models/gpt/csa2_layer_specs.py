# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""ModuleSpecs of a decoder whose layers run CSA2 attention on mHC residual streams."""

from typing import Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.experimental_attention_variant.csa2 import (
    CSA2Compressor,
    CSA2CompressorSubmodules,
    CSA2Indexer,
    CSA2IndexerSubmodules,
    CSA2SelfAttention,
    CSA2SelfAttentionSubmodules,
    CSA2TransformerConfig,
)
from megatron.core.transformer.hyper_connection import (
    HyperConnection,
    HyperConnectionTransformerLayer,
    HyperConnectionTransformerLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


def get_csa2_layer_local_spec(
    num_experts: Optional[int] = None, moe_grouped_gemm: bool = False
) -> ModuleSpec:
    """CSA2 + mHC layer with megatron-core's local (non-TE) linears and RMSNorm.

    One spec serves every layer: what a layer builds (compressor, indexer) follows its role in
    ``config.csa2_layer_pattern``. Set ``normalization="RMSNorm"`` in the config.
    """
    backend = LocalSpecProvider()
    norm = backend.layer_norm(rms_norm=True)
    column, row = backend.column_parallel_linear(), backend.row_parallel_linear()
    attention = ModuleSpec(
        module=CSA2SelfAttention,
        submodules=CSA2SelfAttentionSubmodules(
            linear_q_down=column,
            linear_q_up=column,
            linear_kv=column,
            linear_proj=row,
            norm=norm,
            compressor=ModuleSpec(
                module=CSA2Compressor, submodules=CSA2CompressorSubmodules(linear=column, norm=norm)
            ),
            indexer=ModuleSpec(
                module=CSA2Indexer, submodules=CSA2IndexerSubmodules(linear=column, norm=norm)
            ),
        ),
    )
    return ModuleSpec(
        module=HyperConnectionTransformerLayer,
        submodules=HyperConnectionTransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            pre_mlp_layernorm=norm,
            mlp=get_mlp_module_spec_for_backend(
                backend, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm
            ),
            self_attn_hyper_connection=HyperConnection,
            mlp_hyper_connection=HyperConnection,
        ),
    )


def get_csa2_decoder_block_spec(config: CSA2TransformerConfig) -> TransformerBlockSubmodules:
    """Block spec for ``TransformerBlock(config, spec)``: one CSA2 + mHC layer per layer, final RMSNorm."""
    layer = get_csa2_layer_local_spec(config.num_moe_experts, config.moe_grouped_gemm)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * config.num_layers,
        layer_norm=LocalSpecProvider().layer_norm(rms_norm=True),
    )
