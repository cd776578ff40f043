"""Incremental decode with the CSA2 cache: `prefill` a prompt once, then `decode` a token (or chunk) at a time.

Both are `extend`: the same blocks as the full forward run on the new tokens only, at their true positions,
reading earlier tokens' window KV and compressed segments from the `DecodeCache` (cache.py). Logits at every
position equal the full forward's (tests/model/test_decode.py); a prefill is op for op the full forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from dsv4flash.model.cache import CacheStep, DecodeCache
from dsv4flash.model.state import CSA2State


def extend(model, cache: DecodeCache, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
           images: Sequence | None = None) -> tuple[torch.Tensor, DecodeCache]:
    """Tokens at positions cache.length … (input_ids [B,S]) -> (logits [B,S,vocab] fp32, the extended cache)."""
    if input_ids.ndim != 2 or input_ids.shape[0] != cache.batch_size or input_ids.shape[1] == 0:
        raise ValueError(f"decode: input_ids must be [B={cache.batch_size}, S≥1] for this cache, "
                         f"got {list(input_ids.shape)}")
    if token_types is None:
        token_types = torch.full_like(input_ids, -1)
    elif token_types.shape != input_ids.shape:
        raise ValueError(f"decode: token_types shape {list(token_types.shape)} != input_ids shape "
                         f"{list(input_ids.shape)}")
    step = CacheStep(cache)
    streams, pre_mix, context = model.embed_inputs(input_ids, token_types, images,
                                                   history=(cache.ngram_ids, cache.ngram_types))
    streams, pre_mix, _ = model.run_layers(streams, pre_mix, CSA2State(), dataclasses.replace(context, cache=step))
    return model.logits(streams, pre_mix), step.finish(input_ids, token_types)


def empty_cache(model, batch: int, device=None) -> DecodeCache:
    """The cache of `batch` rows before their first token."""
    keep = model.cfg.text.engram_max_ngram_size - 1 if model.engram_hasher is not None else 0
    return DecodeCache.empty(len(model.layers), batch, keep, device)


def prefill(model, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
            images: Sequence | None = None) -> tuple[torch.Tensor, DecodeCache]:
    """Prompt input_ids [B,S] (image spans expanded, as for `forward`) -> (logits [B,S,vocab], cache)."""
    return extend(model, empty_cache(model, input_ids.shape[0], input_ids.device), input_ids, token_types, images)


def decode(model, cache: DecodeCache, next_ids: torch.Tensor,
           token_types: torch.Tensor | None = None) -> tuple[torch.Tensor, DecodeCache]:
    """next_ids [B] (one token per row) or [B,n] -> (logits [B,vocab] or [B,n,vocab], the extended cache)."""
    if next_ids.ndim == 1:
        types = None if token_types is None else token_types[:, None]
        logits, cache = extend(model, cache, next_ids[:, None], types)
        return logits[:, 0], cache
    return extend(model, cache, next_ids, token_types)
