"""The decoder half of N same-placement adapters in one batched pass over the shared encoder output.

After the shared encoder, every decoder-only adapter starts layer `decoder_start` from the same streams and the
same CSA2 state. Instead of N decoder passes we tile that input N times along the batch (chunk i = adapter i),
and run the decoder half once: every frozen base op covers all N·B rows, each LoRA wrapper adds adapter i's
delta to chunk i only (`dsv4flash.lora.adapter_batch`), routed experts take all chunks' tokens in one base
matmul and each chunk's delta from its own adapter, and layer `decoder_start`'s compressor (the frozen KV write)
runs on one chunk and is tiled. Each row goes through the same ops as in its separate pass, but with other
rows around it: CPU kernels pick GEMM kernels by M and leave a tensor's last elements to a scalar path, so
with every op batched (`invariant=False`, `multi_adapter_logits(..., exact=False)`) the logits agree with
separate passes to fp32 rounding only (max |Δ| ~1e-7 on the tiny model). `invariant=True` (the default of
`multi_adapter_logits`) runs exactly those ops per adapter chunk (`batch_invariant.py`) and is bit-equal.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from contextlib import ExitStack

import torch

from dsv4flash.lora.adapter_batch import AdapterBatch, adapter_batch
from dsv4flash.model.block import TokenContext
from dsv4flash.model.state import CSA2State
from dsv4flash.service.compute.batch_invariant import instance_override, invariant_modules
from dsv4flash.service.compute.batched_cache import split_records, tiled_step


def tile(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """[B, …] -> [n·B, …]: n copies along dim 0 (chunk i = copy i)."""
    return None if t is None else t.repeat(n, *([1] * (t.dim() - 1)))


def tile_state(state: CSA2State, n: int) -> CSA2State:
    """The CSA2 state with every tensor field tiled n times along the batch."""
    return CSA2State.from_parts([tile(t, n) for t in state.tensors()], state.meta())


def tile_context(context: TokenContext, n: int) -> TokenContext:
    """Image mask and Engram row ids tiled n times along the batch."""
    return TokenContext(image_mask=tile(context.image_mask, n),
                        engram_row_ids=tuple(tile(r, n) for r in context.engram_row_ids))


def _source_compressor_once(compressor, n: int, stats: Counter):
    """Layer decoder_start's compressor: identical chunks (frozen KV write) are compressed once and tiled."""

    def forward(x):  # x [n·B, S, D]
        chunks = x.reshape(n, x.shape[0] // n, *x.shape[1:])
        if all(torch.equal(chunks[0], chunks[i]) for i in range(1, n)):
            stats["compressor"] += n - 1
            return tile(type(compressor).forward(compressor, chunks[0]), n)  # [n·B, T, hd]
        return type(compressor).forward(compressor, x)

    return forward


def routed_by_chunk(moe, batch: AdapterBatch, chunk_tokens: int | list[int]):
    """MoE forward over the batch's chunks (`chunk_tokens` tokens each, or a list of each chunk's token count):
    one base matmul per expert, each chunk's rows of it with that chunk's adapter delta. The same ops in the
    same order as `MoE.forward` per token."""
    ends = None if isinstance(chunk_tokens, int) else torch.tensor(chunk_tokens).cumsum(0)

    def forward(x, image_mask=None):  # x [n·B, S, D]
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [n·T, D]
        mask = image_mask.reshape(-1) if image_mask is not None else None
        weights, idx = moe.gate(tokens, mask)  # [n·T, k]
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device)
        for expert_id in torch.unique(idx).tolist():
            token_ids, slot = torch.nonzero(idx == expert_id, as_tuple=True)  # sorted by token: chunks in order
            chunk = token_ids // chunk_tokens if ends is None else torch.bucketize(token_ids, ends, right=True)
            counts = torch.bincount(chunk, minlength=batch.size).tolist()
            with batch.rows(counts):
                routed = moe.experts[expert_id](tokens[token_ids], weights[token_ids, slot].unsqueeze(-1))
            out.index_add_(0, token_ids, routed.float())
        out = out + moe.shared_experts(tokens).float()
        return out.to(x.dtype).reshape(shape)

    return forward


@torch.no_grad()
def batched_decoder_logits(model, slots, adapters, encoded, stats: Counter, invariant: bool = False,
                           steps: list | None = None) -> list[torch.Tensor]:
    """Decoder half + head for N adapters in one pass: encoded = (streams, pre_mix, state, context) of the
    shared encoder ([B, …]); adapters: N tensor dicts of `model`'s placement -> N logits [B,S,V] fp32.

    `invariant`: the batch-dependent ops run per adapter chunk (`batch_invariant.py`), so each adapter's
    logits equal its separate pass bit for bit; otherwise they agree to fp32 rounding. `steps` (incremental
    decode): each adapter's `CacheStep` over its own past; the decoder layers read the N pasts as one batch
    and each step receives its own rows of what they record (`batched_cache.py`)."""
    n = len(adapters)
    streams, pre_mix, state, context = encoded
    start = model.cfg.decoder_start
    batch = AdapterBatch(slots, adapters)
    chunk_tokens = streams.shape[0] * streams.shape[1]
    with ExitStack() as stack:
        stack.enter_context(adapter_batch(batch))
        if invariant:
            stack.enter_context(invariant_modules(model, batch, start))
        compressor = model.layers[start].attn.compressor
        if compressor is not None:
            stack.enter_context(instance_override(compressor, "forward", _source_compressor_once(compressor, n, stats)))
        for block in model.layers[start:]:
            stack.enter_context(instance_override(block.ffn, "forward", routed_by_chunk(block.ffn, batch, chunk_tokens)))
        tiled_context, batched_step = tile_context(context, n), None
        if steps is not None:
            batched_step = tiled_step(steps, start)
            tiled_context = dataclasses.replace(tiled_context, cache=batched_step)
        out_streams, out_mix, _ = model.run_layers(tile(streams, n), tile(pre_mix, n), tile_state(state, n),
                                                   tiled_context, start, None)
        logits = model.logits(out_streams, out_mix)  # [n·B, S, V]
    if batched_step is not None:
        split_records(batched_step, steps)
    return list(logits.chunk(n, dim=0))
