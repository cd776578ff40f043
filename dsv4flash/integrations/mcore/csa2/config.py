"""`CSA2TransformerConfig`: a megatron-core `TransformerConfig` that also carries the V4.1 config it was built from.

Megatron reads its own fields (hidden size, MoE router, recompute, parallel sizes); the CSA2 layers read the
V4.1-specific shapes (latent widths, compress ratios, indexer, mHC, Engram) from `dsv4`, which stays the one
source of architecture truth (`dsv4flash.config`). `transformer_config_from(cfg)` fills every Megatron field
that V4.1 determines and turns the CPU-hostile fusions off; keyword overrides go on top.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import CP_SPLITS as CP_LAYOUTS
from megatron.core.transformer.hyper_connection import HyperConnectionTransformerConfig

from dsv4flash.config import DSV41FlashConfig, load_config

__all__ = ["CSA2TransformerConfig", "transformer_config_from", "CP_LAYOUTS"]

# Selective recompute targets the CSA2 stack implements (MoELayer handles the MoE ones itself).
_SELECTIVE_OK = {"core_attn", "moe", "moe_act", "shared_experts"}


@dataclass
class CSA2TransformerConfig(HyperConnectionTransformerConfig):
    """The mHC TransformerConfig (DSV41-MCORE-010) + `dsv4` (the V4.1 config) + how context-parallel ranks split
    the sequence."""

    dsv4: Optional[DSV41FlashConfig] = None
    """The V4.1 config the CSA2 layers read their shapes and layer plan from (required)."""

    cp_layout: str = "zigzag"
    """Sequence split over context-parallel ranks: 'zigzag' (2·cp chunks, megatron-core's
    `get_batch_on_this_cp_rank`; for THD-packed batches per document, as TE's `thd_get_partitioned_indices`)
    or 'contiguous' (one chunk per rank of the row, or of the packed row)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dsv4 is None:
            raise ValueError("CSA2TransformerConfig.dsv4: the V4.1 config is required "
                             "(use transformer_config_from(cfg))")
        text = self.dsv4.text
        checks = (
            ("num_layers", self.num_layers, text.num_hidden_layers),
            ("hidden_size", self.hidden_size, text.hidden_size),
            ("num_attention_heads", self.num_attention_heads, text.num_attention_heads),
            ("num_moe_experts", self.num_moe_experts, text.n_routed_experts),
            ("moe_router_topk", self.moe_router_topk, text.num_experts_per_tok),
            ("hc_mult", self.hc_mult, text.hc_mult),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters, text.hc_sinkhorn_iters),
            ("hc_eps", self.hc_eps, text.hc_eps),
        )
        for name, got, want in checks:
            if got != want:
                raise ValueError(f"CSA2TransformerConfig.{name} is {got}, but the V4.1 config says {want}")
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"CSA2TransformerConfig.cp_layout must be one of {CP_LAYOUTS}, got {self.cp_layout!r}")
        if self.bias_activation_fusion:
            raise ValueError("CSA2TransformerConfig.bias_activation_fusion must be False: the fused SwiGLU kernels "
                             "of megatron-core 0.19 ignore activation_func_clamp_value (the V4.1 swiglu_limit)")
        if self.sequence_parallel:
            raise ValueError("CSA2TransformerConfig.sequence_parallel is not supported by the CSA2 stack "
                             "(the shared CSA2 state is per sequence, not per sequence shard)")
        if self.pipeline_model_parallel_size > 1:
            # Stages exchange one fp32 payload of variable size (streams + CSA2 state, DSV41-MCORE-010's stage payload).
            if not self.variable_seq_lengths:
                raise ValueError("CSA2TransformerConfig.variable_seq_lengths must be True with "
                                 "pipeline_model_parallel_size > 1: the CSA2 stage payload (streams + cross-layer "
                                 "state) is not [s, b, hidden_size], so its shape is exchanged per micro-batch")
            if self.pipeline_dtype != torch.float32:
                raise ValueError(f"CSA2TransformerConfig.pipeline_dtype must be torch.float32 with "
                                 f"pipeline_model_parallel_size > 1 (the CSA2 stage payload is fp32: it carries "
                                 f"fp32 pre_mix and integer top-k exactly), got {self.pipeline_dtype}")
            if self.virtual_pipeline_model_parallel_size is not None:
                raise ValueError("CSA2TransformerConfig.virtual_pipeline_model_parallel_size must be None: the "
                                 "CSA2 stack runs the non-interleaved 1F1B schedule")
        if self.cuda_graph_impl != "none":
            raise ValueError("CSA2TransformerConfig.cuda_graph_impl must be 'none' (CSA2 state shapes vary "
                             "with packing)")
        if self.recompute_granularity == "selective":
            bad = sorted(set(self.recompute_modules or ()) - _SELECTIVE_OK)
            if bad:
                raise ValueError(f"CSA2TransformerConfig.recompute_modules: {bad} not supported by the CSA2 stack "
                                 f"(supported: {sorted(_SELECTIVE_OK)}; use recompute_granularity='full')")
        heads, groups = text.num_attention_heads, text.o_groups
        tp = self.tensor_model_parallel_size
        if groups % tp:
            raise ValueError(f"tensor_model_parallel_size {tp} must divide text_config.o_groups {groups} "
                             "(each rank owns whole output-projection groups)")
        if heads % tp:
            raise ValueError(f"tensor_model_parallel_size {tp} must divide num_attention_heads {heads}")


def transformer_config_from(cfg: "DSV41FlashConfig | str", **overrides: Any) -> CSA2TransformerConfig:
    """A `CSA2TransformerConfig` for a V4.1 config (flavour name, path or object); overrides win."""
    cfg = load_config(cfg)
    text = cfg.text
    if not text.norm_topk_prob and text.num_experts_per_tok > 1:
        raise ValueError("text_config.norm_topk_prob=false: megatron-core's sqrtsoftplus router always "
                         "normalises a top-k > 1")
    fields: dict[str, Any] = dict(
        dsv4=cfg,
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads,
        num_query_groups=text.num_key_value_heads,
        kv_channels=text.head_dim,
        ffn_hidden_size=text.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=text.rms_norm_eps,
        hc_mult=text.hc_mult,
        hc_sinkhorn_iters=text.hc_sinkhorn_iters,
        hc_eps=text.hc_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        activation_func_clamp_value=text.swiglu_limit,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=text.attention_dropout,
        attention_dropout=text.attention_dropout,
        init_method_std=text.initializer_range,
        num_moe_experts=text.n_routed_experts,
        moe_ffn_hidden_size=text.moe_intermediate_size,
        moe_shared_expert_intermediate_size=text.moe_intermediate_size * text.n_shared_experts,
        moe_router_topk=text.num_experts_per_tok,
        moe_router_score_function="sqrtsoftplus",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # fine-tuning keeps the released selection biases (§5)
        moe_router_topk_scaling_factor=text.routed_scaling_factor,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        use_cpu_initialization=True,
        # CPU-hostile or V4.1-incompatible fusions off; a GPU recipe turns the safe ones back on.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        moe_permute_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    fields.update(overrides)
    return CSA2TransformerConfig(**fields)


def with_dtype(config: CSA2TransformerConfig, dtype: torch.dtype) -> CSA2TransformerConfig:
    """Copy of `config` whose parameters are created in `dtype` (fp32 islands: compressor, head)."""
    if config.params_dtype == dtype:
        return config
    return dataclasses.replace(config, params_dtype=dtype)
