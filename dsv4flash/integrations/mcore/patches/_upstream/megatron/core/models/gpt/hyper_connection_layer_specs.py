# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""ModuleSpec of a GPT layer on mHC residual streams, with megatron-core's stock attention and MLP."""

from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.hyper_connection import (
    HyperConnection,
    HyperConnectionTransformerLayer,
    HyperConnectionTransformerLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec


def get_hyper_connection_layer_local_spec(
    num_experts: Optional[int] = None, moe_grouped_gemm: bool = False, normalization: str = "RMSNorm"
) -> ModuleSpec:
    """The local GPT layer (self-attention, MLP or MoE, norms) run by HyperConnectionTransformerLayer.

    The bias-dropout-add modules of the stock layer are not used: mHC writes each sublayer output to
    the streams with its own ``post`` and ``comb`` coefficients.
    """
    stock = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, normalization=normalization
    ).submodules
    return ModuleSpec(
        module=HyperConnectionTransformerLayer,
        submodules=HyperConnectionTransformerLayerSubmodules(
            input_layernorm=stock.input_layernorm,
            self_attention=stock.self_attention,
            pre_mlp_layernorm=stock.pre_mlp_layernorm,
            mlp=stock.mlp,
            self_attn_hyper_connection=HyperConnection,
            mlp_hyper_connection=HyperConnection,
        ),
    )
