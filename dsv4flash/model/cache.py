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
    """One kv-source layer's compressed stream over the tokens so far.

    The entries of the first chunk (the prompt) are kept apart from those appended by later decode steps, so
    every continuation forked from one prompt (samples, adapters) keeps referencing the same prompt tensors
    instead of copying them into its own growing stream.
    """

    prompt_kv: torch.Tensor  # [B, T0, head_dim] RoPE'd, FP4-fake-quantised latents written by the first chunk
    prompt_index_k: torch.Tensor  # [B, T0, index_head_dim] FP4-fake-quantised index keys of those groups
    appended_kv: torch.Tensor  # [B, T1, head_dim] groups completed by later chunks
    appended_index_k: torch.Tensor  # [B, T1, index_head_dim]
    pending: torch.Tensor  # [B, n < ratio, D] attn_norm'd inputs of the open group (ratio 1: always empty)

    @property
    def groups(self) -> int:
        """Complete groups (compressed entries) so far."""
        return self.prompt_kv.shape[1] + self.appended_kv.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor held, in field order."""
        return (self.prompt_kv, self.prompt_index_k, self.appended_kv, self.appended_index_k, self.pending)

    def compress_kv(self) -> torch.Tensor:
        """[B, T, head_dim] every complete group."""
        return _joined(self.prompt_kv, self.appended_kv)

    def index_k(self) -> torch.Tensor:
        """[B, T, index_head_dim] every complete group's index key."""
        return _joined(self.prompt_index_k, self.appended_index_k)

    def select(self, rows: torch.Tensor) -> "SourceSegment":
        """The segment of batch rows `rows` (repeats allowed)."""
        return SourceSegment(*(_rows(t, rows) for t in self.tensors()))


def _joined(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return first if second.shape[1] == 0 else torch.cat([first, second], dim=1)


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # Fanning one row out (a prompt to its samples) is a view: the forks share the prompt's memory.
    if t.shape[0] == 1:
        return t.expand(rows.numel(), *t.shape[1:])
    return t.index_select(0, rows)


def storage_bytes(*caches: "DecodeCache") -> int:
    """Bytes of distinct memory held by the given caches together (shared tensors and views counted once)."""
    seen: dict[int, int] = {}
    for cache in caches:
        for t in cache.tensors():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class DecodeCache:
    """Everything `decode` needs about tokens 0 … length−1 of every batch row (all rows equally long)."""

    length: int
    window: tuple[torch.Tensor | None, ...]  # per layer [B, ≤ window−1, head_dim] rotated FP8 window KV
    sources: dict[int, SourceSegment]  # kv-source layer id -> its compressed stream
    ngram_ids: torch.Tensor  # [B, ≤ max_ngram−1] last input ids (Engram look-back)
    ngram_types: torch.Tensor  # [B, ≤ max_ngram−1] their token types (≥ 0: image span, DEAD)
    ngram_keep: int = 0  # how many trailing tokens the Engram look-back needs (max_ngram − 1)

    @property
    def batch_size(self) -> int:
        """Rows in the cache."""
        return self.ngram_ids.shape[0]

    def select(self, rows: torch.Tensor | list[int]) -> "DecodeCache":
        """The cache of batch rows `rows` in that order (repeats allowed: one prompt fanned out to n samples)."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.ngram_ids.device)
        if rows.ndim != 1 or (rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.batch_size)):
            raise IndexError(f"DecodeCache.select: rows must be a list in [0, {self.batch_size}), got {rows.tolist()}")
        return DecodeCache(self.length, tuple(None if w is None else _rows(w, rows) for w in self.window),
                           {l: s.select(rows) for l, s in self.sources.items()},
                           _rows(self.ngram_ids, rows), _rows(self.ngram_types, rows), self.ngram_keep)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds."""
        held = [w for w in self.window if w is not None] + [t for s in self.sources.values() for t in s.tensors()]
        return held + [self.ngram_ids, self.ngram_types]

    @classmethod
    def empty(cls, n_layers: int, batch: int, ngram_keep: int, device=None) -> "DecodeCache":
        """The cache before the first token; `ngram_keep` = max_ngram − 1 with Engram, else 0."""
        none = torch.zeros(batch, 0, dtype=torch.int64, device=device)
        return cls(0, (None,) * n_layers, {}, none, none, ngram_keep)


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
        self.window[layer] = keys[:, max(keys.shape[1] - (window - 1), 0):].clone()  # not a view of the chunk
        return keys

    def source(self, layer: int) -> SourceSegment | None:
        """The kv source's compressed stream before this chunk (None before the first token)."""
        return self.past.sources.get(layer)

    def keep_source(self, layer: int, compress_kv: torch.Tensor, index_k: torch.Tensor, pending: torch.Tensor):
        """Append this chunk's new groups to the source's stream -> (compress_kv, index_k) over every group."""
        past = self.past.sources.get(layer)
        if past is None:  # the first chunk: its groups stay a separate, shareable part
            empty_kv, empty_ik = compress_kv[:, :0], index_k[:, :0]
            segment = SourceSegment(compress_kv, index_k, empty_kv, empty_ik, pending)
        else:
            segment = SourceSegment(past.prompt_kv, past.prompt_index_k, _joined(past.appended_kv, compress_kv),
                                    _joined(past.appended_index_k, index_k), pending)
        self.sources[layer] = segment
        return segment.compress_kv(), segment.index_k()

    def fork(self) -> "CacheStep":
        """A second view of this chunk with what has been recorded so far (tensors shared, not copied)."""
        return CacheStep(self.past, dict(self.window), dict(self.sources))

    def finish(self, input_ids: torch.Tensor, token_types: torch.Tensor) -> DecodeCache:
        """The cache after this chunk (input_ids/token_types [B,S] are the chunk's tokens)."""
        past = self.past
        window = tuple(self.window.get(l, w) for l, w in enumerate(past.window))
        ids = torch.cat([past.ngram_ids, input_ids], dim=1)
        types = torch.cat([past.ngram_types, token_types], dim=1)
        cut = max(ids.shape[1] - past.ngram_keep, 0)
        return DecodeCache(past.length + input_ids.shape[1], window, {**past.sources, **self.sources},
                           ids[:, cut:].clone(), types[:, cut:].clone(), past.ngram_keep)
