"""CSA2 self-attention as a Megatron module (docs/architecture.md §2.3), built from a ModuleSpec.

Every layer computes its own query and window KV. A Full layer compresses the groups this rank owns,
publishes compressed KV and index keys (assembled over context-parallel ranks: each entry has one owner),
index sources pick their own top-k, Reuse layers attend to the top-k published below. The cross-layer
state comes in and goes out as an explicit `CSA2State` value; nothing is stashed on the module.

Tensor parallelism splits query heads, the sink and whole output groups; the latent side (window KV,
compressor, indexer) is replicated, and the keys shared by all heads are entered into the tensor-parallel
region so their gradient is summed over ranks. Activations are [s, b, h] at the boundary (megatron-core)
and batch-first inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.experimental_attention_variant.csa2_layout import CSA2TokenLayout
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from dsv4flash.integrations.mcore.csa2.modules import (
    GroupedOutputProjection,
    KeepFP32,
    build_linear,
    linear_forward,
    sharded_state_dict_with_tp_axes,
)
from dsv4flash.model.attention import sparse_attention
from dsv4flash.model.quant import fake_quant_compressed_kv, fake_quant_window_kv
from dsv4flash.model.rope import apply_rope, rope_angles, rope_frequencies
from dsv4flash.model.state import CSA2State

__all__ = ["CSA2AttentionSubmodules", "CSA2SelfAttention"]


@dataclass
class CSA2AttentionSubmodules:
    """Linear classes, norm builder and the optional compressor / indexer specs of one CSA2 layer."""

    column_linear: Union[ModuleSpec, type, None] = None  # query heads
    row_linear: Union[ModuleSpec, type, None] = None  # output projection
    replicated_linear: Union[ModuleSpec, type, None] = None  # latent-side projections
    norm: Any = None
    compressor: Union[ModuleSpec, type, None] = None
    indexer: Union[ModuleSpec, type, None] = None


class CSA2SelfAttention(KeepFP32, MegatronModule):
    """One layer's CSA2 attention; see the module docstring. Built as `build_module(spec, config=, layer_number=)`."""

    _fp32_params = ("attn_sink",)

    def __init__(self, config: Any, submodules: CSA2AttentionSubmodules, layer_number: int,
                 pg_collection: Any = None, **_unused: Any) -> None:
        super().__init__(config)
        text = config.dsv4.text
        self.plan = config.dsv4.backbone_plan[layer_number - 1]
        self.text = text
        tp = config.tensor_model_parallel_size
        self.heads = divide(text.num_attention_heads, tp)
        self.head_dim, self.window = text.head_dim, text.sliding_window
        self.groups = divide(text.o_groups, tp)
        self.pg_collection = pg_collection
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        norm = submodules.norm
        self.linear_q_down = build_linear(submodules.replicated_linear, text.hidden_size, text.q_lora_rank, config,
                                          "replicated", name="q_down")
        self.q_layernorm = norm(config=config, hidden_size=text.q_lora_rank, eps=text.rms_norm_eps)
        self.linear_q_up = build_linear(submodules.column_linear, text.q_lora_rank,
                                        text.num_attention_heads * text.head_dim, config, "column", name="q_up")
        self.linear_kv = build_linear(submodules.replicated_linear, text.hidden_size, text.head_dim, config,
                                      "replicated", name="kv")
        self.kv_layernorm = norm(config=config, hidden_size=text.head_dim, eps=text.rms_norm_eps)
        heads_per_group = text.num_attention_heads // text.o_groups
        self.linear_o_group_proj = GroupedOutputProjection(config, text.o_groups, heads_per_group * text.head_dim,
                                                           text.o_lora_rank)
        self.linear_proj = build_linear(submodules.row_linear, text.o_groups * text.o_lora_rank, text.hidden_size,
                                        config, "row", name="proj")
        self.attn_sink = torch.nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        setattr(self.attn_sink, "tensor_model_parallel", True)
        setattr(self.attn_sink, "partition_dim", 0)
        setattr(self.attn_sink, "partition_stride", 1)
        plan = self.plan
        self.compressor = (build_module(submodules.compressor, config=config, ratio=plan.ratio)
                           if plan.has_compressor else None)
        self.indexer = (build_module(submodules.indexer, config=config, owns_keys=plan.has_compressor)
                        if plan.has_indexer else None)
        self.checkpoint_core_attention = (config.recompute_granularity == "selective"
                                          and "core_attn" in (config.recompute_modules or ()))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Distributed checkpoint: `attn_sink` is split over tensor-parallel ranks like the heads."""
        return sharded_state_dict_with_tp_axes(self, {"attn_sink": 0}, prefix, sharded_offsets, metadata)

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """Complex rotations for integer positions (this layer's RoPE base, YaRN when compressed)."""
        freqs = rope_frequencies(self.text, self.plan.rope_theta, self.plan.yarn)
        return rope_angles(freqs, positions)

    def forward(self, hidden_states: torch.Tensor, state: CSA2State, layout: CSA2TokenLayout,
                selections: dict | None = None) -> tuple[torch.Tensor, CSA2State]:
        """hidden_states [s,b,h] (attn_norm'd) -> (output [s,b,h], state with what this layer publishes).

        `selections`: the checkpointed chunk's record of discrete choices (recorded on the first pass,
        replayed by the recompute); None outside checkpointing.
        """
        x = hidden_states.transpose(0, 1).contiguous()  # [B,S,D]
        batch, seq, _ = x.shape
        rot = self.rotation(layout.pos)  # [B,S,rope/2]
        qr = self.q_layernorm(linear_forward(self.linear_q_down, x))  # [B,S,q_lora]
        q = linear_forward(self.linear_q_up, qr).unflatten(-1, (self.heads, self.head_dim))
        q = apply_rope(q, rot)  # [B,S,H,hd]
        kv = fake_quant_window_kv(apply_rope(self.kv_layernorm(linear_forward(self.linear_kv, x)), rot))
        keys = layout.extend(kv)  # [B,E,hd], key = value
        allowed = layout.window_mask(self.window)  # [B,S,E]
        if self.plan.ratio:
            state = self._csa2(x, qr, rot, state, layout, selections)
            compressed = state.compress_kv  # [B,Tmax,hd]
            total = compressed.shape[1]
            picked = torch.zeros(batch, seq, total + 1, dtype=torch.bool, device=x.device)
            picked.scatter_(-1, state.topk % (total + 1), True)  # −1 lands in the dump slot
            keys = torch.cat([keys, compressed], dim=1)
            allowed = torch.cat([allowed, picked[..., :-1]], dim=-1)
        if self.config.tensor_model_parallel_size > 1:
            keys = copy_to_tensor_model_parallel_region(keys)  # every head reads them: sum their gradient
        o = self._core_attention(q, keys, allowed)  # [B,S,H,hd]
        o = apply_rope(o, rot, inverse=True)
        z = self.linear_o_group_proj(o.reshape(batch, seq, self.groups, -1))  # [B,S,G·o_lora]
        out = linear_forward(self.linear_proj, z)  # [B,S,D], summed over tensor-parallel ranks
        return out.transpose(0, 1).contiguous(), state

    def _core_attention(self, q, keys, allowed):
        def attend(q, keys, allowed):
            """The sparse attention core (window + picked compressed keys + sink)."""
            return sparse_attention(q, keys, allowed, self.attn_sink, self.head_dim**-0.5)

        if self.checkpoint_core_attention and self.training:
            return tensor_parallel.checkpoint(attend, False, q, keys, allowed)
        return attend(q, keys, allowed)

    def _csa2(self, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor, state: CSA2State,
              layout: CSA2TokenLayout, selections: dict | None) -> CSA2State:
        plan = self.plan
        table = layout.groups(plan.ratio)
        replay = selections.get(plan.layer_id) if selections is not None else None
        if plan.has_compressor:
            latent = self.compressor.pool(layout.extend(self.compressor.token_inputs(x)), table, x.dtype)  # [B,N,hd]
            group_rot = self.rotation(table.owner_start)  # RoPE at each group's first position
            # Every row entry [B,Tmax,hd]; under context parallelism the sum of every owner's part.
            compress_kv = layout.publish(fake_quant_compressed_kv(apply_rope(latent, group_rot)), table)
            if replay is not None:
                index_k = replay["index_k"]
            else:
                # Index keys only feed the discrete top-k (no LM gradient, §13): keep them out of the graph, so
                # full recompute does not hand the indexer zero gradients where the plain run has none.
                index_k = layout.publish(self.indexer.index_keys(latent.detach(), group_rot), table,
                                         differentiable=False).detach()
            state = state.publish(compress_kv=compress_kv, index_k=index_k, ratio=plan.ratio, kv_layer=plan.layer_id)
        if state.kv_layer != plan.kv_source:
            raise RuntimeError(f"layer {plan.layer_id}: expected compressed KV of layer {plan.kv_source}, the state "
                               f"holds layer {state.kv_layer}'s (was the CSA2 state threaded through every layer?)")
        if plan.has_indexer:
            if replay is not None:
                candidates, topk = replay["candidates"], replay["topk"]
            else:
                scores = self.indexer.scores(qr, x, state.index_k, rot, table.visible())  # [B,S,Tmax]
                candidates = None
                if plan.is_candidate_source:
                    candidates = self.indexer.candidate_pool(scores, table)
                elif plan.uses_candidates:
                    scores = scores.masked_fill(~state.candidates, float("-inf"))
                topk = self.indexer.select(scores, table)
                if selections is not None:
                    # Detached aliases: the chunk's outputs are marked by autograd as outputs of the checkpoint
                    # node, and replaying that very object would loop the recompute back into its own node.
                    selections[plan.layer_id] = {"index_k": state.index_k.detach(), "candidates": candidates,
                                                 "topk": topk}
            if plan.is_candidate_source:
                state = state.publish(candidates=candidates, candidate_layer=plan.layer_id)
            state = state.publish(topk=topk, topk_layer=plan.layer_id)
        if state.topk_layer != plan.index_source:
            raise RuntimeError(f"layer {plan.layer_id}: expected top-k of layer {plan.index_source}, the state holds "
                               f"layer {state.topk_layer}'s")
        return state

    def extra_repr(self) -> str:
        """The layer's CSA2 role."""
        p = self.plan
        return f"layer={p.layer_id}, mode={p.mode}, ratio={p.ratio}, kv_source={p.kv_source}, index_source={p.index_source}"
