"""The V4.1 decoder stack as a megatron-core `TransformerBlock` whose full recompute keeps the CSA2 state exact.

Why a block of our own: in megatron-core 0.19 the shared `checkpointed_forward` passes `context` through
`save_for_backward` (so it must be one tensor) and `HybridStack` drops it without recompute. V4.1 layers
hand each other the mHC `pre` and four CSA2 tensors, and a Full layer's compressor is trained by every
later Reuse/Reindex layer. If that state crossed a checkpoint boundary in a side channel (a module
attribute, a dict, a carrier object) it would be produced under `no_grad` and the producer would silently
lose every consumer's gradient (docs/upstream.md §1.2). Here each checkpointed chunk is a function of
explicit tensors — (streams, pre_mix, compress_kv, index_k, topk, candidates) in, the same out — run through
megatron-core's `tensor_parallel.checkpoint` with the config's `recompute_method` ('uniform' or 'block')
and `recompute_num_layers`, so full recompute reproduces the no-recompute gradients.

The block takes the embedding output [s, b, h], expands it to `hc` streams, runs the layers and returns
`final_layernorm(collapse(streams, last pre))` [s, b, h], exactly the hidden state a stock block returns.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import (
    build_csa2_layout,
    cp_spans,
    span_positions,
)
from megatron.core.transformer.hyper_connection import (
    collapse_streams,
    decode_stage_payload,
    encode_stage_payload,
    pack_streams,
    unpack_streams,
)
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import make_viewless_tensor

from dsv4flash.integrations.mcore.csa2.carry import CSA2Context, CSA2Tokens
from dsv4flash.integrations.mcore.pipeline import stage_is_trainable
from dsv4flash.model.state import CSA2State

__all__ = ["CSA2TransformerBlock"]

_INDEX_KEYS = 3  # payload part: streams, pre_mix, compress_kv, index_k, topk, candidates


class CSA2TransformerBlock(TransformerBlock):
    """The V4.1 blocks of one pipeline stage (all of them at PP = 1); specs come from `get_csa2_block_spec`.

    A stage that does not start the stack reads its streams and the CSA2 state from the pipeline payload
    (`set_input_tensor`); one that does not end it returns the payload instead of the final hidden state
    (DSV41-MCORE-010's `encode_stage_payload`: streams, `pre_mix` and the four CSA2 state tensors in one fp32
    tensor, the state's layer ids as its meta; index keys leave the graph as at their producer).
    """

    def __init__(self, config: Any, spec: Any, post_layer_norm: bool = True, pre_process: bool = True,
                 post_process: bool = True, pg_collection: Any = None, vp_stage: Optional[int] = None) -> None:
        super().__init__(config=config, spec=spec, post_layer_norm=post_layer_norm, pre_process=pre_process,
                         post_process=post_process, pg_collection=pg_collection, vp_stage=vp_stage)
        text = config.dsv4.text
        self.hc = text.hc_mult
        ratios = [p.ratio for p in config.dsv4.backbone_plan if p.ratio]
        ngram = text.engram_max_ngram_size if text.engram_layer_ids else 1
        self.halo_width = max(text.sliding_window - 1, max(ratios, default=1) - 1, ngram - 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Layers differ (Full/Reuse/Reindex, Engram), so they are never stacked into one sharded tensor."""
        metadata = dict(metadata or {})
        metadata["non_homogeneous_layers"] = True
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    # ---- micro-batch bookkeeping ------------------------------------------------------------------
    def _cp_group(self) -> Any:
        group = getattr(self.pg_collection, "cp", None)
        return None if group is None or torch.distributed.get_world_size(group) == 1 else group

    def cp_positions(self, local_len: int, packed_seq_params: Any = None) -> Optional[torch.Tensor]:
        """Global slots [local_len] of this rank's tokens, or None without context parallelism.

        A THD-packed micro-batch is split per document ('zigzag', megatron-core's `get_batch_on_this_cp_rank`
        with `cu_seqlens`) or as one packed row ('contiguous'); `packed_seq_params` describes the global row.
        """
        group = self._cp_group()
        if group is None:
            return None
        size = torch.distributed.get_world_size(group)
        bounds = [0, local_len * size]
        if packed_seq_params is not None:
            padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
            bounds = (padded if padded is not None else packed_seq_params.cu_seqlens_q).tolist()
        return span_positions(cp_spans(size, bounds, self.config.cp_layout)[torch.distributed.get_rank(group)])

    def build_tokens(self, hidden_states: torch.Tensor, *, packed_seq_params: Any = None,
                     padding_mask: Optional[torch.Tensor] = None, image_mask: Optional[torch.Tensor] = None,
                     engram_rows: tuple = ()) -> CSA2Tokens:
        """Layout + constants for a micro-batch whose embeddings are `hidden_states` [s, b, h] (only the
        shape and device are read: later pipeline stages pass any [s, b, ...] tensor)."""
        seq_len, batch = hidden_states.shape[:2]
        layout = build_csa2_layout(batch, seq_len, hidden_states.device, self.halo_width, packed_seq_params,
                                   self._cp_group(), padding_mask=padding_mask, cp_split=self.config.cp_layout)
        if padding_mask is None and not bool(layout.valid.all()):
            # Padding slots of a packed batch: the MoE router must see them as padding too.
            padding_mask = ~layout.valid
        return CSA2Tokens(layout=layout, padding_mask=padding_mask, image_mask=image_mask, engram_rows=engram_rows)

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context: Any = None, context_mask: Any = None, rotary_pos_emb: Any = None,
                rotary_pos_cos: Any = None, rotary_pos_sin: Any = None, rotary_pos_cos_sin: Any = None,
                attention_bias: Any = None, inference_context: Any = None, packed_seq_params: Any = None,
                sequence_len_offset: Any = None, padding_mask: Optional[torch.Tensor] = None,
                extract_layer_indices: Any = None, *, inference_params: Any = None,
                dynamic_inference_decode_only: Any = None, csa2_tokens: Optional[CSA2Tokens] = None) -> torch.Tensor:
        """hidden_states [s,b,h] (embeddings) -> [s,b,h] after the last collapse and the final norm.

        Pipeline stages: without pre_process the input is the payload set by `set_input_tensor` (pass
        `csa2_tokens`); without post_process the result is the payload for the next stage.
        """
        if context is not None:
            raise ValueError("CSA2TransformerBlock has no cross-attention `context`; the CSA2 carry is internal")
        if extract_layer_indices:
            raise NotImplementedError("CSA2TransformerBlock does not extract intermediate hidden states")
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("CSA2TransformerBlock has no inference (KV-cache) path; serve with vLLM")
        if self.pre_process:
            tokens = csa2_tokens if csa2_tokens is not None else self.build_tokens(
                hidden_states, packed_seq_params=packed_seq_params, padding_mask=padding_mask)
            seq_len, batch, dim = hidden_states.shape
            streams = pack_streams(hidden_states.unsqueeze(2).expand(seq_len, batch, self.hc, dim))  # [s,b,hc·D]
            ctx = CSA2Context.initial(hidden_states, self.hc, tokens)
        else:
            if csa2_tokens is None:
                raise ValueError("a CSA2 pipeline stage after the first needs csa2_tokens (built from the "
                                 "micro-batch's input ids: DSV41MegatronModel.tokens)")
            payload = self.input_tensor[0] if isinstance(self.input_tensor, (list, tuple)) else self.input_tensor
            if payload is None:
                raise ValueError("CSA2 pipeline stage: no input tensor was set (set_input_tensor)")
            (streams, pre_mix, *state), meta = decode_stage_payload(payload, detach=(_INDEX_KEYS,))
            if streams is None or pre_mix is None:
                raise ValueError("CSA2 pipeline stage: the payload carries no streams / pre_mix")
            ctx = CSA2Context(pre_mix=pre_mix, state=CSA2State.from_parts(tuple(state), meta), tokens=csa2_tokens)
        recompute = self.config.recompute_granularity == "full" and self.training
        if (recompute and torch.is_grad_enabled() and not streams.requires_grad
                and stage_is_trainable([self])):
            # A frozen embedding (or a stage input detached by the pipeline early stop) would leave every checkpointed
            # chunk without a grad input, and trainable layers inside (LoRA) would get no gradient; the same fix
            # Megatron-Bridge applies (docs/upstream.md §2.3). A stage with nothing trainable keeps its graph empty,
            # so its backward is skipped.
            streams = streams.detach().requires_grad_(True)
        run = dict(attention_mask=attention_mask, packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        if recompute:
            streams, ctx = self._checkpointed_forward(streams, ctx, run)
        else:
            streams, ctx = self._run_layers(0, len(self.layers), streams, ctx, run)
        if not self.post_process:
            return encode_stage_payload((streams, *ctx.to_tensors()), ctx.state.meta())  # [N, 1, 1] fp32
        hidden = collapse_streams(unpack_streams(streams, self.hc), ctx.pre_mix)  # [s,b,D]
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return make_viewless_tensor(inp=hidden, requires_grad=True, keep_graph=True)

    def _run_layers(self, start: int, end: int, streams: torch.Tensor, ctx: CSA2Context, run: dict):
        for layer in self.layers[start:end]:
            streams, ctx = layer(hidden_states=streams, context=ctx, **run)
        return streams, ctx

    def _checkpointed_forward(self, streams: torch.Tensor, ctx: CSA2Context, run: dict):
        """Megatron's 'uniform' / 'block' full recompute over explicit (streams, carry) tensors."""
        n, k = len(self.layers), self.config.recompute_num_layers
        method = self.config.recompute_method
        if method == "uniform":
            chunks = [(i, min(i + k, n), True) for i in range(0, n, k)]
        elif method == "block":
            chunks = [(i, i + 1, i < k) for i in range(n)]
        else:
            raise ValueError(f"recompute_method must be 'uniform' or 'block' for full recompute, got {method!r}")
        for start, end, checkpointed in chunks:
            if checkpointed:
                streams, ctx = self._checkpointed_chunk(start, end, streams, ctx, run)
            else:
                streams, ctx = self._run_layers(start, end, streams, ctx, run)
        return streams, ctx

    def _checkpointed_chunk(self, start: int, end: int, streams: torch.Tensor, ctx: CSA2Context, run: dict):
        tokens, meta_in = ctx.tokens, ctx.state.meta()
        meta_out: list = []
        selections: dict = {}  # filled by the first pass, replayed by the recompute (see CSA2Context)

        def chunk(streams, *carry):
            """Layers [start, end) as a function of explicit tensors: (streams, carry...) -> same."""
            c = CSA2Context.from_tensors(carry, meta_in, tokens, selections)
            streams, c = self._run_layers(start, end, streams, c, run)
            meta_out.append(c.state.meta())  # static per layer plan; recorded for the caller
            return (streams, *c.to_tensors())

        args = (streams, *ctx.to_tensors())
        if self.config.fp8 or self.config.fp4:
            from megatron.core.extensions.transformer_engine import te_checkpoint

            outs = te_checkpoint(chunk, self.config.distribute_saved_activations,
                                 tensor_parallel.random.get_cuda_rng_tracker, self.pg_collection.tp, *args)
        else:
            outs = tensor_parallel.checkpoint(chunk, self.config.distribute_saved_activations, *args)
        return outs[0], CSA2Context.from_tensors(outs[1:], meta_out[0], tokens)  # no replay past the chunk
