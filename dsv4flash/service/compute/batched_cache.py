"""Decode caches of N adapters as one batch for the batched decoder: tile their decoder layers' past, split
what the batched step records back into each adapter's own `CacheStep`.
`concat_caches` joins whole caches of requests at the same position into one batch (the continuous batcher).

Only layers ≥ decoder_start are read by a decoder half: their window KV and the kv-source segments those
layers own. Member i's rows are chunk i of the batch (rows i·B … (i+1)·B − 1), as in `batched_decoder.tile`.
"""

from __future__ import annotations

import dataclasses

import torch

from dsv4flash.model.cache import CacheStep, DecodeCache, SourceSegment


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(parts, dim=0)


def tiled_step(steps: list[CacheStep], start: int) -> CacheStep:
    """One CacheStep whose past holds every member's decoder-layer past, chunk i = member i (all equally long)."""
    pasts = [s.past for s in steps]
    lengths = {p.length for p in pasts}
    if len(lengths) != 1:
        raise ValueError(f"batched decode: the adapters' caches differ in length ({sorted(lengths)})")
    first = pasts[0]
    window = tuple(_cat([p.window[l] for p in pasts]) if l >= start else None for l in range(len(first.window)))
    sources = {l: SourceSegment(*(torch.cat(parts, dim=0) for parts in zip(*(p.sources[l].tensors() for p in pasts))))
               for l in first.sources if l >= start}
    past = dataclasses.replace(first, window=window, sources=sources,
                               ngram_ids=_cat([p.ngram_ids for p in pasts]),
                               ngram_types=_cat([p.ngram_types for p in pasts]))
    return CacheStep(past)


def split_records(batched: CacheStep, steps: list[CacheStep]) -> None:
    """Copy member i's rows of what the batched step recorded into steps[i] (its own tensors, no views of the
    batch). A source segment keeps the member's own prompt part, so forks of one prefill keep sharing it."""
    n = len(steps)
    for i, step in enumerate(steps):
        for layer, keys in batched.window.items():
            step.window[layer] = keys.chunk(n, dim=0)[i].clone()
        for layer, seg in batched.sources.items():
            own = [t.chunk(n, dim=0)[i].clone() for t in seg.tensors()[2:]]
            prompt = step.past.sources.get(layer)
            if prompt is None:  # the first chunk (prefill) wrote the prompt part itself
                head = [t.chunk(n, dim=0)[i].clone() for t in seg.tensors()[:2]]
            else:
                head = [prompt.prompt_kv, prompt.prompt_index_k]
            step.sources[layer] = SourceSegment(*head, *own)



def _joined_segment(seg: SourceSegment) -> SourceSegment:
    """The segment with its prompt and appended parts as one prompt part (the same groups, the same order)."""
    kv, ik = seg.compress_kv(), seg.index_k()
    return SourceSegment(kv, ik, kv[:, :0], ik[:, :0], seg.pending)


def concat_caches(caches: list[DecodeCache]) -> DecodeCache:
    """The caches of several requests as one batch (rows in order); all must be at the same length.

    Requests whose prompts differed in length split the same groups differently between a segment's prompt and
    appended parts; those segments are joined first (attention reads the two parts concatenated anyway)."""
    if len(caches) == 1:
        return caches[0]
    lengths = {c.length for c in caches}
    if len(lengths) != 1:
        raise ValueError(f"concat_caches: the caches differ in length ({sorted(lengths)})")
    first = caches[0]
    window = tuple(None if first.window[l] is None else torch.cat([c.window[l] for c in caches], dim=0)
                   for l in range(len(first.window)))
    sources = {}
    for layer in first.sources:
        segs = [c.sources[layer] for c in caches]
        if len({s.prompt_kv.shape[1] for s in segs}) > 1:
            segs = [_joined_segment(s) for s in segs]
        sources[layer] = SourceSegment(*(torch.cat(parts, dim=0) for parts in zip(*(s.tensors() for s in segs))))
    return DecodeCache(first.length, window, sources, torch.cat([c.ngram_ids for c in caches], dim=0),
                       torch.cat([c.ngram_types for c in caches], dim=0), first.ngram_keep)
