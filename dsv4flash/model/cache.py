"""Incremental-decode cache of the reference model: what each later token needs from the earlier ones.

Per layer only the sliding-window KV of the last `window − 1` tokens (a new query sees itself plus those).
Per kv-source layer the compressed KV and index keys of every complete group so far, plus the attn_norm'd
inputs of the still-open group (ratio > 1: a new entry appears every `ratio` tokens). For the Engram hash the
last `max_ngram − 1` input ids and token types (image spans stay DEAD in the look-back). Nothing else
crosses tokens: the mHC streams, `pre_mix`, the MoE and the indexer's top-k and candidate pool are per
token, so each new query recomputes them from the cached keys. See docs/decode.md.

A `DecodeCache` is an immutable value: `decode` returns a new one and leaves its input usable, so one prompt
prefill can fan out to many continuations (`select`) or adapters (`shares_with`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SourceSegment:
    """One kv-source layer's compressed stream over the tokens so far."""

    compress_kv: torch.Tensor  # [B, T, head_dim] RoPE'd, FP4-fake-quantised latents of the complete groups
    index_k: torch.Tensor  # [B, T, index_head_dim] FP4-fake-quantised index keys
    pending: torch.Tensor  # [B, n < ratio, D] attn_norm'd inputs of the open group (ratio 1: always empty)

    @property
    def groups(self) -> int:
        """Complete groups (compressed entries) so far."""
        return self.compress_kv.shape[1]

    def select(self, rows: torch.Tensor) -> "SourceSegment":
        """The segment of batch rows `rows` (repeats allowed)."""
        return SourceSegment(*(t.index_select(0, rows) for t in (self.compress_kv, self.index_k, self.pending)))


@dataclass(frozen=True)
class DecodeCache:
    """Everything `decode` needs about tokens 0 … length−1 of every batch row (all rows equally long)."""

    length: int
    window: tuple[torch.Tensor | None, ...]  # per layer [B, ≤ window−1, head_dim] rotated FP8 window KV
    sources: dict[int, SourceSegment]  # kv-source layer id -> its compressed stream
    ngram_ids: torch.Tensor  # [B, ≤ max_ngram−1] last input ids (Engram look-back)
    ngram_types: torch.Tensor  # [B, ≤ max_ngram−1] their token types (≥ 0: image span, DEAD)

    @property
    def batch_size(self) -> int:
        """Rows in the cache."""
        return self.ngram_ids.shape[0]

    def select(self, rows: torch.Tensor | list[int]) -> "DecodeCache":
        """The cache of batch rows `rows` in that order (repeats allowed: one prompt fanned out to n samples)."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.ngram_ids.device)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.batch_size):
            raise IndexError(f"DecodeCache.select: rows must lie in [0, {self.batch_size}), got {rows.tolist()}")
        return DecodeCache(self.length, tuple(None if w is None else w.index_select(0, rows) for w in self.window),
                           {l: s.select(rows) for l, s in self.sources.items()},
                           self.ngram_ids.index_select(0, rows), self.ngram_types.index_select(0, rows))

    def nbytes(self, layers: range | None = None, sources: bool = True) -> int:
        """Bytes held by the window KV of `layers` (all by default) plus, if `sources`, every source segment."""
        layers = range(len(self.window)) if layers is None else layers
        total = sum(self.window[l].nbytes for l in layers if self.window[l] is not None)
        if sources:
            total += sum(t.nbytes for s in self.sources.values() for t in (s.compress_kv, s.index_k, s.pending))
        return total + self.ngram_ids.nbytes + self.ngram_types.nbytes

    @classmethod
    def empty(cls, n_layers: int, batch: int, device=None) -> "DecodeCache":
        """The cache before the first token."""
        none = torch.zeros(batch, 0, dtype=torch.int64, device=device)
        return cls(0, (None,) * n_layers, {}, none, none)


@dataclass
class CacheStep:
    """One forward chunk's view of the cache: layers read the past from it and record this chunk's KV into it.

    Created per `extend` call and handed to the blocks in `TokenContext.cache`; `finish` turns what the
    layers recorded into the next (immutable) `DecodeCache`.
    """

    past: DecodeCache
    window: dict[int, torch.Tensor] = field(default_factory=dict)
    sources: dict[int, SourceSegment] = field(default_factory=dict)

    @property
    def start(self) -> int:
        """Position of the chunk's first token."""
        return self.past.length

    def window_keys(self, layer: int, kv: torch.Tensor, window: int) -> torch.Tensor:
        """kv [B,S,hd] of this chunk -> [B, W+S, hd]: the cached window keys, then these; keeps the last window−1."""
        cached = self.past.window[layer]
        keys = kv if cached is None else torch.cat([cached, kv], dim=1)
        self.window[layer] = keys[:, max(keys.shape[1] - (window - 1), 0):]
        return keys

    def source(self, layer: int) -> SourceSegment | None:
        """The kv source's compressed stream before this chunk (None before the first token)."""
        return self.past.sources.get(layer)

    def keep_source(self, layer: int, compress_kv: torch.Tensor, index_k: torch.Tensor, pending: torch.Tensor):
        """Append this chunk's new groups to the source's stream -> (compress_kv, index_k) over every group."""
        past = self.past.sources.get(layer)
        if past is not None:
            compress_kv = torch.cat([past.compress_kv, compress_kv], dim=1)
            index_k = torch.cat([past.index_k, index_k], dim=1)
        self.sources[layer] = SourceSegment(compress_kv, index_k, pending)
        return compress_kv, index_k

    def finish(self, input_ids: torch.Tensor, token_types: torch.Tensor, keep_ngram: int) -> DecodeCache:
        """The cache after this chunk (input_ids/token_types [B,S] are the chunk's tokens)."""
        past = self.past
        window = tuple(self.window.get(l, w) for l, w in enumerate(past.window))
        ids = torch.cat([past.ngram_ids, input_ids], dim=1)
        types = torch.cat([past.ngram_types, token_types], dim=1)
        cut = max(ids.shape[1] - keep_ngram, 0)
        return DecodeCache(past.length + input_ids.shape[1], window, {**past.sources, **self.sources},
                           ids[:, cut:], types[:, cut:])
