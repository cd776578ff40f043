"""One V4.1 block: [Engram] → mHC(attn) → mHC(MoE), single-pass wiring with lagged `pre` (§2.2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv4flash.config import DSV41FlashConfig, LayerPlan
from dsv4flash.model.attention import Attention
from dsv4flash.model.hyper_connection import HyperConnectionSite, collapse, expand
from dsv4flash.model.moe import MoE
from dsv4flash.model.norm import RMSNorm
from dsv4flash.model.state import CSA2State

if TYPE_CHECKING:
    from dsv4flash.model.cache import CacheStep


@dataclass(frozen=True)
class TokenContext:
    """Per-token facts every block reads: image-span rows and Engram row ids (computed once per forward)."""

    image_mask: torch.Tensor  # [B,S] bool, True on every position of an image span (delimiters included)
    engram_row_ids: tuple[torch.Tensor, ...] = ()  # one [B,S,n_orders·n_heads] int64 per Engram layer
    cache: CacheStep | None = None  # incremental decode: earlier tokens' KV, and where this chunk's goes


class Block(nn.Module):
    """Block `layers.{i}`: attention and MoE sublayers on `hc_mult` residual streams."""

    def __init__(self, cfg: DSV41FlashConfig, plan: LayerPlan, n_experts: int, topk: int,
                 dtype=torch.float32, device=None) -> None:
        super().__init__()
        text = cfg.text
        self.plan = plan
        dim, hc = text.hidden_size, text.hc_mult
        n_coeff = (2 + hc) * hc  # pre, post and the hc×hc comb
        self.attn_norm = RMSNorm(dim, text.rms_norm_eps, dtype=dtype, device=device)
        self.attn = Attention(text, plan, dtype, device)
        self.ffn_norm = RMSNorm(dim, text.rms_norm_eps, dtype=dtype, device=device)
        self.ffn = MoE(text, n_experts, topk, cfg.vision.enabled, dtype, device)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(
                torch.empty(n_coeff, hc * dim, dtype=torch.float32, device=device)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(
                torch.zeros(n_coeff, dtype=torch.float32, device=device)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(
                torch.ones(3, dtype=torch.float32, device=device)))
        self.hc = HyperConnectionSite(text)
        if plan.has_engram:
            from dsv4flash.model.engram import Engram

            self.engram = Engram(cfg, plan.engram_index, dtype=dtype, device=device)
        else:
            self.engram = None

    def forward(self, x: torch.Tensor, pre_mix: torch.Tensor, state: CSA2State, context: TokenContext):
        """x: [B,S,hc,D], pre_mix: [B,S,hc] (previous FFN-site pre) -> (x, ffn_pre, state)."""
        if self.engram is not None:
            x = self.engram(x, context.engram_row_ids[self.plan.engram_index], ~context.image_mask)
        residual = x
        attn_pre, attn_post, attn_comb = self.hc(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        y, state = self.attn(self.attn_norm(collapse(x, pre_mix)), state, context.cache)  # [B,S,D]
        x = expand(y, residual, attn_post, attn_comb)
        residual = x
        ffn_pre, ffn_post, ffn_comb = self.hc(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        y = self.ffn(self.ffn_norm(collapse(x, attn_pre)), context.image_mask)  # [B,S,D]
        return expand(y, residual, ffn_post, ffn_comb), ffn_pre, state
