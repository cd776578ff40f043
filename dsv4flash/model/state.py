"""Cross-layer CSA2 state, handed from block to block as an explicit immutable value (§2.6).

Three independent inheritance chains: compressed KV + index keys come from the latest kv source, top-k from
the latest index source, the candidate mask from the candidate source. Every tensor stays in the autograd
graph, so a kv-source compressor receives gradient from all of its consumers. Because the state is a plain
value (never a side channel), an activation-checkpointed block can take it as input and return it as output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_TENSOR_FIELDS = ("compress_kv", "index_k", "topk", "candidates")


@dataclass(frozen=True)
class CSA2State:
    """What the layers below have published; `None` until the corresponding source has run."""

    compress_kv: torch.Tensor | None = None  # [B, T, head_dim]  FP4-fake-quantised, RoPE'd latents
    index_k: torch.Tensor | None = None  # [B, T, index_head_dim]  FP4-fake-quantised index keys
    topk: torch.Tensor | None = None  # [B, S, k] int64 compressed positions, -1 = empty slot
    candidates: torch.Tensor | None = None  # [B, S, T] bool hierarchical candidate pool per query
    ratio: int = 0  # compress ratio of the kv source that published compress_kv
    kv_layer: int = -1  # which layer published compress_kv / index_k
    topk_layer: int = -1  # which layer published topk
    candidate_layer: int = -1  # which layer published candidates

    def publish(self, **changes) -> "CSA2State":
        """A new state with some fields replaced (the old value is left untouched)."""
        return dataclasses.replace(self, **changes)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensor fields in a fixed order, for passing through checkpoint/pipeline boundaries."""
        return tuple(getattr(self, name) for name in _TENSOR_FIELDS)

    def meta(self) -> tuple[int, int, int, int]:
        """The non-tensor fields (static per layer plan)."""
        return (self.ratio, self.kv_layer, self.topk_layer, self.candidate_layer)

    @classmethod
    def from_parts(cls, tensors, meta) -> "CSA2State":
        """Rebuild from `tensors()` and `meta()`."""
        ratio, kv_layer, topk_layer, candidate_layer = meta
        return cls(*tensors, ratio=ratio, kv_layer=kv_layer, topk_layer=topk_layer, candidate_layer=candidate_layer)
