"""What a CSA2 layer hands the next one besides the packed mHC streams: the layer-to-layer carry.

It travels in megatron-core's `context` slot (`TransformerLayer.forward(...) -> (hidden_states, context)`),
so the per-layer calling convention is the stock one. Under full recompute the stack flattens it into the
explicit tensor inputs and outputs of the checkpointed function (`to_tensors` / `from_tensors`): the
`pre_mix` collapse weights and the four `CSA2State` tensors cross every checkpoint boundary inside the
autograd graph, while `CSA2Tokens` (integer bookkeeping of the micro-batch) is a per-forward constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.transformer.experimental_attention_variant.csa2_layout import CSA2TokenLayout

from dsv4flash.model.state import CSA2State

__all__ = ["CSA2Tokens", "CSA2Context", "CARRY_TENSORS"]

CARRY_TENSORS = 1 + len(CSA2State().tensors())  # pre_mix + compress_kv, index_k, topk, candidates


@dataclass(frozen=True)
class CSA2Tokens:
    """Per-micro-batch constants every layer reads (no gradients)."""

    layout: CSA2TokenLayout  # DSV41-MCORE-008/009's token layout (packing, padding, context parallelism)
    padding_mask: Optional[torch.Tensor] = None  # [b, s] bool, True = padding (megatron-core convention)
    image_mask: Optional[torch.Tensor] = None  # [b, s] bool, True on image-span tokens (selects bias_vl)
    engram_rows: tuple[torch.Tensor, ...] = ()  # per Engram layer: row ids [s, b, n_orders·n_heads]

    def engram_token_mask(self) -> Optional[torch.Tensor]:
        """[s, b] bool: tokens that take an Engram delta (not image spans), or None for all."""
        return None if self.image_mask is None else (~self.image_mask).transpose(0, 1)


@dataclass(frozen=True)
class CSA2Context:
    """The carry between CSA2 layers: the next collapse weights, the shared state and the token constants."""

    pre_mix: torch.Tensor  # [s, b, hc] fp32: the previous FFN-site `pre` (one-hot on stream 0 at the start)
    state: CSA2State
    tokens: CSA2Tokens
    # Inside a checkpointed chunk: the discrete selections (index keys, top-k, candidates) each index source
    # made in the chunk's first pass, by layer id. The recompute replays them instead of re-running the
    # indexer, so backward sees exactly the forward's choices (like MoE router replay) and skips work that has
    # no gradient. None outside checkpointing.
    selections: Optional[dict] = None

    def advance(self, pre_mix: torch.Tensor, state: CSA2State) -> "CSA2Context":
        """The context the next layer receives."""
        return CSA2Context(pre_mix=pre_mix, state=state, tokens=self.tokens, selections=self.selections)

    def to_tensors(self) -> tuple[Optional[torch.Tensor], ...]:
        """Flatten for a checkpoint boundary: (pre_mix, compress_kv, index_k, topk, candidates)."""
        return (self.pre_mix, *self.state.tensors())

    @classmethod
    def from_tensors(cls, tensors, meta, tokens: CSA2Tokens, selections: Optional[dict] = None) -> "CSA2Context":
        """Inverse of `to_tensors`; `meta` is `CSA2State.meta()` (which layers published what)."""
        pre_mix, *state = tensors
        return cls(pre_mix=pre_mix, state=CSA2State.from_parts(tuple(state), meta), tokens=tokens,
                   selections=selections)

    @classmethod
    def initial(cls, hidden_states: torch.Tensor, hc: int, tokens: CSA2Tokens) -> "CSA2Context":
        """Start of the stack: pre_mix is the one-hot on stream 0, nothing published yet."""
        s, b = hidden_states.shape[:2]
        pre_mix = torch.zeros(s, b, hc, dtype=torch.float32, device=hidden_states.device)
        pre_mix[..., 0] = 1.0
        return cls(pre_mix=pre_mix, state=CSA2State(), tokens=tokens)
