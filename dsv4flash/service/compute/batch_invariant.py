"""Batch invariance for the batched decoder: the ops whose per-row result depends on the rows around them run
once per adapter chunk, with the row count of that adapter's separate pass.

Measured on CPU (tests/service/test_shared_encoder.py, probes in docs/service.md): two kinds of op give a row a
result that depends on the whole tensor.

* GEMMs that fold the batch into M (`F.linear`, `x @ W.t()`, the grouped `wo_a` einsum): MKL picks its kernel
  and blocking by M, so 8·M rows and M rows round differently (seen for M ≤ ~34 at these widths).
* Transcendental elementwise ops (`sigmoid`, `silu`, `softplus`, `exp` outside a row-wise softmax): the
  vectorised loop runs over the whole tensor and leaves the last numel mod 2·vector-width elements to a scalar
  path with other rounding, so which rows get the scalar path depends on the total size.

Everything else in the decoder half is batch-invariant by construction and stays batched: exact elementwise
ops (add, mul, div, sqrt, rsqrt = 1/sqrt, clamp, masks, bit tricks), row-wise reductions and softmax over a
fixed row length, `sort`/`topk` per row, and einsums whose batch dim is the adapter-tiled batch (attention,
indexer scores, the hyper-connection collapse/expand: one small GEMM per batch element, same sizes).

So under `invariant_modules` each Linear (LoRA wrappers included), the grouped `wo_a`, every mHC site's gates
(its `@` and sigmoids; the Sinkhorn projection after them is row-wise and stays batched), the router's scores
(GEMM + softplus), each Engram layer (its `wkv` GEMM and gate) and each expert run per chunk; a routed
expert's chunk is the rows it got from that adapter, exactly the rows it gets in that adapter's separate pass.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from dsv4flash.lora.adapter_batch import AdapterBatch
from dsv4flash.model.attention import GroupedOutputProjection
from dsv4flash.model.engram import Engram
from dsv4flash.model.hyper_connection import HyperConnectionSite
from dsv4flash.model.moe import Expert, Gate


@contextmanager
def instance_override(owner, method: str, fn):
    """`owner.<method> = fn` for the block (an instance attribute: the class and other instances stay untouched)."""
    setattr(owner, method, fn)
    try:
        yield
    finally:
        owner.__dict__.pop(method, None)


def _cat(parts: list):
    """Concatenate per-chunk results along dim 0 (tuples of tensors field by field)."""
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(field, dim=0) for field in zip(*parts))
    return torch.cat(parts, dim=0)


def chunked(module: nn.Module, method: str, batch: AdapterBatch, row_args: int):
    """module.<method> run once per adapter chunk of dim 0; the first `row_args` positional args are per row
    (None passes through), the rest go to every chunk as they are. Within chunk i the batch's segments name
    only adapter i, so a LoRA wrapper inside adds adapter i's delta to all of the chunk's rows."""
    function = getattr(type(module), method)

    def run(*args, **kwargs):
        bounds = batch.bounds(args[0].shape[0])
        saved, parts = batch.segments, []
        try:
            for i, (start, end) in enumerate(bounds):
                if end == start:
                    continue
                batch.segments = [0] * batch.size  # what `batch.rows` sets, without a context manager per call
                batch.segments[i] = end - start
                chunk = [a[start:end] if k < row_args and a is not None else a for k, a in enumerate(args)]
                parts.append(function(module, *chunk, **kwargs))
        finally:
            batch.segments = saved
        return parts[0] if len(parts) == 1 else _cat(parts)

    return run


def _per_chunk(module: nn.Module) -> tuple[str, int] | None:
    """(method, leading per-row args) of the batch-dependent part of `module`, for the kinds that have one."""
    if isinstance(module, Expert):
        return "forward", 2  # (x, route_weight): its GEMMs and silu
    if isinstance(module, Engram):
        return "forward", 3  # (x, row_ids, token_mask): its `wkv` GEMM and the gate's transcendental
    if isinstance(module, HyperConnectionSite):
        return "gates", 1  # its GEMM and sigmoids; the Sinkhorn projection is row-wise and stays batched
    if isinstance(module, Gate):
        return "scores", 1  # GEMM + softplus; top-k and the weight normalisation are per row
    if isinstance(module, (nn.Linear, GroupedOutputProjection)):
        return "forward", 1
    return None


@contextmanager
def invariant_modules(model: nn.Module, batch: AdapterBatch, start: int, shared_source: bool = True):
    """Within the block, the batch-dependent modules of layers ≥ `start` and the head run per adapter chunk.

    `shared_source`: layer `start`'s compressor (the frozen KV write) runs once, on one chunk
    (`batched_decoder._source_compressor_once`), and is left alone; False (a whole-model pass, every row its own
    input) chunks it like the rest."""
    roots = [model.layers[i] for i in range(start, len(model.layers))] + [model.head]
    source = model.layers[start].attn.compressor if shared_source else None
    skip = {id(m) for m in source.modules()} if source is not None else set()
    with ExitStack() as stack:
        for root in roots:
            for module in root.modules():
                if id(module) in skip:
                    continue  # the source compressor, or inside an expert (it runs per chunk as a whole)
                part = _per_chunk(module)
                if part is None:
                    continue
                if isinstance(module, (Expert, Engram)):
                    skip.update(id(m) for m in module.modules())
                method, row_args = part
                stack.enter_context(instance_override(module, method, chunked(module, method, batch, row_args)))
        yield
