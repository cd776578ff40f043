"""Lightning indexer and hierarchical candidates as a Megatron module (docs/architecture.md §2.5), packing-aware.

Scores are computed for all queries against the row's entries at once. The discrete steps (candidate
blocks, top-k) are taken per sequence: queries are grouped by their sequence's entry count T and each group
is cut to exactly its own T entries before selection, so every selection runs on the same row a single
sequence would present; ties, which ReLU makes common, go to the lower position unless a parity check
switches the rule (`dsv4flash.model.indexer.topk_select` / `tie_rule`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Union

import torch
from megatron.core.transformer.experimental_attention_variant.csa2_layout import CSA2GroupTable as GroupTable
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from dsv4flash.integrations.mcore.csa2.modules import build_linear, linear_forward
from dsv4flash.model.indexer import topk_select
from dsv4flash.model.quant import fake_quant_index
from dsv4flash.model.rope import apply_rope

__all__ = ["IndexerSubmodules", "CSA2Indexer"]


@dataclass
class IndexerSubmodules:
    """Linear class (replicated) and norm builder of the indexer."""

    linear: Union[ModuleSpec, type, None] = None
    norm: Any = None


def _per_sequence(table: GroupTable) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Yield (query rows [n] into the flattened [B·S], their first entry [n], T) per distinct entry count T > 0."""
    counts = table.q_count.reshape(-1)
    for total in torch.unique(counts).tolist():
        if total <= 0:
            continue
        rows = torch.nonzero(counts == total, as_tuple=True)[0]
        yield rows, table.q_base.reshape(-1)[rows], int(total)


def _own_entries(scores: torch.Tensor, rows: torch.Tensor, base: torch.Tensor, total: int) -> torch.Tensor:
    """scores [B,S,Tmax] -> [n, T]: each query's own sequence entries, in order."""
    flat = scores.reshape(-1, scores.shape[-1])[rows]
    cols = base.unsqueeze(-1) + torch.arange(total, device=scores.device)
    return flat.gather(1, cols)


class CSA2Indexer(MegatronModule):
    """`indexer.{linear_q_up, linear_weights_proj[, linear_k, k_layernorm]}` (release `wq_b, weights_proj, wk, k_norm`)."""

    def __init__(self, config: Any, submodules: IndexerSubmodules, owns_keys: bool) -> None:
        super().__init__(config)
        text = config.dsv4.text
        self.n_heads, self.head_dim = text.index_n_heads, text.index_head_dim
        self.topk = text.index_topk
        self.block_size, self.topk_blocks = text.candidate_block_size, text.candidate_topk_blocks
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.linear_q_up = build_linear(submodules.linear, text.q_lora_rank, self.n_heads * self.head_dim, config,
                                        "replicated", name="indexer_q_up")
        self.linear_weights_proj = build_linear(submodules.linear, text.hidden_size, self.n_heads, config,
                                                "replicated", name="indexer_weights_proj")
        if owns_keys:
            self.linear_k = build_linear(submodules.linear, text.head_dim, self.head_dim, config, "replicated",
                                         name="indexer_k")
            self.k_layernorm = submodules.norm(config=config, hidden_size=self.head_dim, eps=text.rms_norm_eps)
        else:
            self.linear_k = self.k_layernorm = None

    def index_keys(self, latent: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """Unrotated latents [B,N,hd] -> FP4 index keys [B,N,ihd], RoPE at the groups' positions."""
        return fake_quant_index(apply_rope(self.k_layernorm(linear_forward(self.linear_k, latent)), rotation))

    def scores(self, qr: torch.Tensor, x: torch.Tensor, index_k: torch.Tensor, rotation: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """Σ_h w_ih·ReLU(q_ih·k_e) in the activation dtype, −inf where e is not visible. -> [B,S,Tmax]."""
        q = linear_forward(self.linear_q_up, qr).unflatten(-1, (self.n_heads, self.head_dim))  # [B,S,h,ihd]
        q = fake_quant_index(apply_rope(q, rotation))
        weights = linear_forward(self.linear_weights_proj, x) * self.weight_scale  # [B,S,h]
        dots = torch.relu(torch.einsum("bshd,btd->bsht", q, index_k.to(q.dtype)))  # [B,S,h,Tmax]
        scores = (dots * weights.unsqueeze(-1)).sum(dim=2)
        return scores.masked_fill(~visible, float("-inf"))

    @torch.no_grad()
    def candidate_pool(self, scores: torch.Tensor, table: GroupTable) -> torch.Tensor:
        """Level-1 pool of the candidate source: top blocks by max score, newest visible block pinned."""
        out = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        flat_out = out.view(-1, scores.shape[-1])
        reach = table.q_reach.reshape(-1)
        bs = self.block_size
        for rows, base, total in _per_sequence(table):
            own = _own_entries(scores, rows, base, total)  # [n, T]
            n_blocks = -(-total // bs)
            padded = torch.full((own.shape[0], n_blocks * bs), float("-inf"), dtype=own.dtype, device=own.device)
            padded[:, :total] = own
            block_scores = padded.unflatten(-1, (n_blocks, bs)).amax(-1)  # [n, nb]
            lengths = reach[rows]
            newest = (lengths - 1).clamp(min=0) // bs
            pin = (torch.arange(n_blocks, device=own.device) == newest[:, None]) & (lengths[:, None] > 0)
            block_scores = block_scores.masked_fill(pin, float("inf"))
            values, indices = topk_select(block_scores, min(self.topk_blocks, n_blocks))
            chosen = torch.zeros_like(block_scores, dtype=torch.bool)
            chosen.scatter_(-1, indices, values > float("-inf"))
            mask = chosen.repeat_interleave(bs, dim=-1)[:, :total]
            cols = base.unsqueeze(-1) + torch.arange(total, device=own.device)
            flat_out[rows.unsqueeze(-1), cols] = mask
        return out

    @torch.no_grad()
    def select(self, scores: torch.Tensor, table: GroupTable) -> torch.Tensor:
        """Top-k entries per query, re-sorted by position; unreachable picks become −1. -> [B,S,k] int64."""
        batch, seq, _ = scores.shape
        k_max = min(self.topk, table.num_entries)
        out = torch.full((batch * seq, k_max), -1, dtype=torch.long, device=scores.device)
        reach = table.q_reach.reshape(-1)
        for rows, base, total in _per_sequence(table):
            own = _own_entries(scores, rows, base, total)
            k = min(self.topk, total)  # the sequence's own group count bounds k (REF: end_pos // ratio)
            idx = topk_select(own, k)[1].sort(dim=-1).values
            picked = torch.where(idx < reach[rows].unsqueeze(-1), idx + base.unsqueeze(-1), torch.full_like(idx, -1))
            out[rows, :k] = picked
        return out.view(batch, seq, k_max)
