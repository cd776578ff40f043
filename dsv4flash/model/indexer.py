"""Lightning indexer and hierarchical candidates (§2.5): which compressed positions each query attends to.

The selection is discrete, so indexer parameters receive no LM gradient (the release trains none).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from dsv4flash.config import TextConfig
from dsv4flash.model.norm import RMSNorm
from dsv4flash.model.quant import fake_quant_index
from dsv4flash.model.rope import apply_rope


def visible_lengths(seq_len: int, ratio: int, device, start: int = 0) -> torch.Tensor:
    """Compressed positions visible to each query i (at position start+i): (start+i+1)//ratio (complete groups)."""
    return torch.div(torch.arange(start + 1, start + seq_len + 1, device=device), ratio, rounding_mode="floor")


def topk_lowest_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim; ties go to the lower position.

    `torch.topk` breaks ties however its kernel likes, and exact ties are common here (ReLU'd index
    scores are often exactly 0), so every implementation selects through this one rule.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


TIE_RULES = ("lowest_first", "kernel")
_tie_rule = ["lowest_first"]


def topk_select(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k under the active tie rule: "lowest_first" (the default, deterministic) or "kernel" (`torch.topk`).

    The release picks with `torch.topk` on CUDA, whose order among exactly equal scores is unspecified;
    "kernel" lets a parity check run the reference the way the release's device would.
    """
    if _tie_rule[0] == "kernel":
        values, indices = torch.topk(scores, k, dim=-1)
        return values, indices
    return topk_lowest_first(scores, k)


@contextmanager
def tie_rule(rule: str) -> Iterator[None]:
    """Run the indexers (reference and Megatron) with top-k tie rule `rule` inside the block."""
    if rule not in TIE_RULES:
        raise ValueError(f"tie rule must be one of {TIE_RULES}, got {rule!r}")
    previous, _tie_rule[0] = _tie_rule[0], rule
    try:
        yield
    finally:
        _tie_rule[0] = previous


def same_selection_up_to_ties(scores: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two top-k picks [.., k] from `scores` [.., T] agree but for the order among equal scores (-1 = no pick)."""
    def picked(idx):
        got = scores.gather(-1, idx.clamp(min=0)).masked_fill(idx < 0, float("nan"))
        return got.sort(dim=-1, descending=True).values
    return a.shape == b.shape and torch.equal(picked(a).nan_to_num(-7.0), picked(b).nan_to_num(-7.0)) and \
        torch.equal((a < 0).sum(-1), (b < 0).sum(-1))


class Indexer(nn.Module):
    """Index query `wq_b` + head weights `weights_proj`; on kv sources also the key path `wk` + `k_norm`."""

    def __init__(self, text: TextConfig, owns_keys: bool, dtype, device) -> None:
        super().__init__()
        self.n_heads, self.head_dim = text.index_n_heads, text.index_head_dim
        self.topk = text.index_topk
        self.block_size, self.topk_blocks = text.candidate_block_size, text.candidate_topk_blocks
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.wq_b = nn.Linear(text.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype, device=device)
        self.weights_proj = nn.Linear(text.hidden_size, self.n_heads, bias=False, dtype=dtype, device=device)
        if owns_keys:
            self.wk = nn.Linear(text.head_dim, self.head_dim, bias=False, dtype=dtype, device=device)
            self.k_norm = RMSNorm(self.head_dim, text.rms_norm_eps, dtype=dtype, device=device)
        else:
            self.wk = self.k_norm = None

    def index_keys(self, latent: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """Unrotated latents [B,T,hd] -> FP4 index keys [B,T,index_head_dim], RoPE at group positions."""
        return fake_quant_index(apply_rope(self.k_norm(self.wk(latent)), rotation))

    def scores(self, qr: torch.Tensor, x: torch.Tensor, index_k: torch.Tensor, rotation: torch.Tensor,
               ratio: int, start: int = 0) -> torch.Tensor:
        """score(i, j) = Σ_h w_ih·ReLU(q_ih·k_j) in the activation dtype, −inf where j is not visible to i.

        qr: [B,S,q_lora]; x: [B,S,D] (the attn_norm'd input); index_k: [B,T,ihd] -> [B,S,T]; query i sits at
        position start+i (start > 0 in incremental decode).
        """
        batch, seq, _ = qr.shape
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [B,S,h,ihd]
        q = fake_quant_index(apply_rope(q, rotation))
        weights = self.weights_proj(x) * self.weight_scale  # [B,S,h]
        dots = torch.relu(torch.einsum("bshd,btd->bsht", q, index_k.to(q.dtype)))  # [B,S,h,T]
        scores = (dots * weights.unsqueeze(-1)).sum(dim=2)  # [B,S,T]
        reach = visible_lengths(seq, ratio, qr.device, start)[:, None]  # [S,1]
        visible = torch.arange(index_k.shape[1], device=qr.device) < reach
        return scores.masked_fill(~visible, float("-inf"))

    def candidate_pool(self, scores: torch.Tensor, ratio: int, start: int = 0) -> torch.Tensor:
        """Level-1 pool of the candidate source: top blocks by max score, newest block pinned. -> [B,S,T] bool."""
        batch, seq, total = scores.shape
        n_blocks = -(-total // self.block_size)
        padded = torch.full((batch, seq, n_blocks * self.block_size), float("-inf"),
                            dtype=scores.dtype, device=scores.device)
        padded[..., :total] = scores
        block_scores = padded.unflatten(-1, (n_blocks, self.block_size)).amax(-1)  # [B,S,nb]
        lengths = visible_lengths(seq, ratio, scores.device, start)  # [S]
        newest = (lengths - 1).clamp(min=0) // self.block_size
        pin = (torch.arange(n_blocks, device=scores.device) == newest[:, None]) & (lengths[:, None] > 0)
        block_scores = block_scores.masked_fill(pin, float("inf"))
        keep = min(self.topk_blocks, n_blocks)
        values, indices = topk_select(block_scores, keep)
        chosen = torch.zeros_like(block_scores, dtype=torch.bool)
        chosen.scatter_(-1, indices, values > float("-inf"))
        return chosen.repeat_interleave(self.block_size, dim=-1)[..., :total]

    def select(self, scores: torch.Tensor, ratio: int, start: int = 0) -> torch.Tensor:
        """Top-k compressed positions per query, re-sorted by position; unreachable picks become −1. -> [B,S,k]."""
        batch, seq, total = scores.shape
        k = min(self.topk, (start + seq) // ratio)  # the chunk end, shared by every query of the chunk
        idx = topk_select(scores, k)[1].sort(dim=-1).values
        reach = visible_lengths(seq, ratio, scores.device, start)[:, None]  # [S,1]
        return torch.where(idx < reach, idx, torch.full_like(idx, -1))
