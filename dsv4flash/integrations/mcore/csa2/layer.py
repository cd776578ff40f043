"""One V4.1 block as a megatron-core `TransformerLayer` (docs/architecture.md §2.2): [Engram], mHC(attn), mHC(MoE).

The stock slots keep their stock meaning — `input_layernorm` (attn_norm), `self_attention` (CSA2),
`pre_mlp_layernorm` (ffn_norm), `mlp` (MoE) — plus the mHC coefficients of the two sites
(`self_attn_hyper_connection`, `mlp_hyper_connection`: DSV41-MCORE-010's `HyperConnection`) and `engram` (only
on Engram layers). The calling convention is the stock one:
`layer(hidden_states=[s,b,hc·D], context=CSA2Context, ...) -> (hidden_states, context)`, where the
context carries the lagged mHC `pre`, the shared CSA2 state and the micro-batch constants (see `carry.py`).

Tensor parallelism in training: megatron-core 0.19's `MoELayer` needs sequence parallelism with TP > 1,
while the CSA2 attention and mHC need whole sequences (the shared state is per sequence). The layer
therefore runs only its MoE sequence-parallel: it scatters the normalised FFN input over the TP ranks
along the sequence, runs an `MoELayer` built with `sequence_parallel=True` (its router sees the local
tokens, experts and shared expert gather them as megatron-core does), and all-gathers the output back
to every rank (backward: each rank keeps its own slice of the gradient, which is identical on all ranks
because everything after the MoE is replicated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import copy

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.hyper_connection import (
    HyperConnectionTransformerLayerSubmodules,
    collapse_streams,
    expand_streams,
    pack_streams,
    unpack_streams,
)
from megatron.core.transformer.transformer_layer import TransformerLayer

from dsv4flash.integrations.mcore.csa2.carry import CSA2Context
from dsv4flash.model.engram import Engram

__all__ = ["CSA2LayerSubmodules", "CSA2TransformerLayer", "CSA2Engram"]


@dataclass
class CSA2LayerSubmodules(HyperConnectionTransformerLayerSubmodules):
    """The mHC layer's submodules plus the optional Engram lookup."""

    engram: Union[ModuleSpec, type, None] = None


class CSA2Engram(Engram):
    """The reference Engram layer (table + `wkv` + gate) with a Megatron constructor; per token, layout-free."""

    def __init__(self, config: Any, engram_index: int, **_unused: Any) -> None:
        super().__init__(config.dsv4, engram_index, dtype=config.params_dtype)
        for param in self.parameters():
            setattr(param, "sequence_parallel", False)


class CSA2TransformerLayer(TransformerLayer):
    """V4.1 block `layers.{layer_number-1}` on packed mHC streams; see the module docstring."""

    def __init__(self, config: Any, submodules: CSA2LayerSubmodules, layer_number: int = 1, **kwargs: Any) -> None:
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        self.plan = config.dsv4.backbone_plan[self.layer_number - 1]
        self.hc = config.dsv4.text.hc_mult
        self.self_attn_hyper_connection = build_module(submodules.self_attn_hyper_connection, config=config)
        self.mlp_hyper_connection = build_module(submodules.mlp_hyper_connection, config=config)
        if self.plan.has_engram:
            if submodules.engram is None:
                raise ValueError(f"layer {self.plan.layer_id} has an Engram lookup but its spec has no `engram` "
                                 "submodule")
            # Positional config: Engram implementations name it differently (`config`, `cfg`).
            self.engram = build_module(submodules.engram, config, engram_index=self.plan.engram_index)
        else:
            self.engram = None
        self.moe_sequence_parallel = config.tensor_model_parallel_size > 1
        if self.moe_sequence_parallel:
            # Rebuild the MoE with a sequence-parallel copy of the config (the CSA2 config itself refuses
            # sequence_parallel: attention and mHC stay on whole sequences).
            moe_config = copy.copy(config)
            moe_config.sequence_parallel = True
            self.mlp = submodules.mlp(config=moe_config, pg_collection=self.pg_collection,
                                      is_mtp_layer=self.is_mtp_layer)
            if hasattr(self.mlp, "set_layer_number"):
                self.mlp.set_layer_number(self.layer_number)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context: Optional[CSA2Context] = None, context_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Any = None, rotary_pos_cos: Any = None, rotary_pos_sin: Any = None,
                rotary_pos_cos_sin: Any = None, attention_bias: Any = None, inference_context: Any = None,
                packed_seq_params: Any = None, sequence_len_offset: Any = None, padding_mask: Any = None,
                **_unused: Any):
        """hidden_states [s,b,hc·D], context CSA2Context -> (hidden_states [s,b,hc·D], next CSA2Context).

        CSA2 attention is causal by construction (window + visible groups) and derives its masks, positions
        and RoPE from `context.tokens.layout`; `attention_mask` / `rotary_pos_emb` are not read.
        """
        if not isinstance(context, CSA2Context):
            raise TypeError(f"CSA2TransformerLayer (layer {self.plan.layer_id}) needs the CSA2 carry as `context` "
                            f"(got {type(context).__name__}); run it inside CSA2TransformerBlock")
        if inference_context is not None:
            raise NotImplementedError("CSA2TransformerLayer has no inference (KV-cache) path; serve with vLLM")
        tokens = context.tokens
        x = unpack_streams(hidden_states, self.hc)  # [s,b,hc,D]
        if self.engram is not None:
            if len(tokens.engram_rows) <= self.plan.engram_index:
                raise ValueError(f"layer {self.plan.layer_id} has an Engram lookup but the micro-batch carries no "
                                 "Engram row ids: build the tokens with DSV41MegatronModel.tokens(input_ids, ...) "
                                 "and pass them to the block as csa2_tokens")
            x = self.engram(x, tokens.engram_rows[self.plan.engram_index], tokens.engram_token_mask())
        residual = x
        attn_pre, attn_post, attn_comb = self.self_attn_hyper_connection(x)
        y, state = self.self_attention(self.input_layernorm(collapse_streams(x, context.pre_mix)), context.state,
                                       tokens.layout, context.selections)  # [s,b,D]
        x = expand_streams(y, residual, attn_post, attn_comb)
        residual = x
        ffn_pre, ffn_post, ffn_comb = self.mlp_hyper_connection(x)
        h = self.pre_mlp_layernorm(collapse_streams(x, attn_pre))
        y = self._mlp(h, tokens)
        x = expand_streams(y, residual, ffn_post, ffn_comb)
        return pack_streams(x), context.advance(ffn_pre, state)

    def _mlp(self, h: torch.Tensor, tokens) -> torch.Tensor:
        """h [s,b,D] -> MoE output [s,b,D]; sequence-parallel inside under tensor parallelism."""
        padding_mask, image_mask = tokens.padding_mask, tokens.image_mask
        if self.moe_sequence_parallel:
            tp, rank = self.tp_group.size(), self.tp_group.rank()
            if h.shape[0] % tp:
                raise ValueError(f"layer {self.plan.layer_id}: {h.shape[0]} local tokens do not split over "
                                 f"tensor_model_parallel_size {tp} for the sequence-parallel MoE; pad the "
                                 f"sequence to a multiple of {tp}")
            chunk = h.shape[0] // tp
            h = scatter_to_sequence_parallel_region(h, group=self.tp_group)  # [s/tp, b, D]
            local = slice(rank * chunk, (rank + 1) * chunk)
            padding_mask = padding_mask[:, local] if padding_mask is not None else None  # [b, s/tp]
            image_mask = image_mask[:, local] if image_mask is not None else None
        kwargs = {"padding_mask": padding_mask}
        if image_mask is not None:
            kwargs["image_mask"] = image_mask
        out = self.mlp(h, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if self.moe_sequence_parallel:
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False,
                                                       group=self.tp_group)  # [s, b, D]
        return out
