"""Single-pass mHC: manifold-constrained hyper-connections over `hc_mult` residual streams (§4).

All coefficient math runs in fp32. The `pre` computed at one site is the collapse weight of the *next*
site (lagged pre), so a block returns its FFN-site `pre` for the next block's attention input.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4flash.config import TextConfig


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + ε, then alternate column/row normalisation: `iters` of each, ending on columns."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def collapse(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i·X_i over streams, accumulated in fp32. x: [B,S,hc,D], weights: [B,S,hc] -> [B,S,D]."""
    return torch.einsum("bshd,bsh->bsd", x.float(), weights.float()).to(x.dtype)


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_j = post_j·y + Σ_i C[i,j]·X_i in fp32. y: [B,S,D], residual: [B,S,hc,D], comb: [B,S,hc,hc]."""
    mixed = torch.einsum("bsid,bsij->bsjd", residual.float(), comb.float())
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(residual.dtype)


class HyperConnectionSite(nn.Module):
    """Coefficient generator H(X) of one site; its three parameters live on the owning block.

    The release stores them flat on the block (`hc_attn_fn`, `hc_attn_base`, `hc_attn_scale`), so this
    module holds no parameters of its own and reads them through `bind`.
    """

    def __init__(self, text: TextConfig) -> None:
        super().__init__()
        self.hc = text.hc_mult
        self.iters = text.hc_sinkhorn_iters
        self.hc_eps = text.hc_eps
        self.norm_eps = text.rms_norm_eps

    def forward(self, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
        """x: [B,S,hc,D] -> (pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc] as [in, out])."""
        pre, post, comb_logits = self.gates(x, fn, base, scale)
        return pre, post, sinkhorn(comb_logits, self.iters, self.hc_eps)

    def gates(self, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
        """x: [B,S,hc,D] -> (pre [B,S,hc], post [B,S,hc], comb logits [B,S,hc,hc]) before the Sinkhorn projection."""
        hc = self.hc
        flat = x.float().flatten(2)  # [B,S,hc·D]
        mix = (flat @ fn.float().t()) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        base = base.float()
        pre = torch.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + self.hc_eps
        post = 2 * torch.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb_logits = (mix[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
        return pre, post, comb_logits
