"""KV compressor of a CSA2 Full layer (§2.4): softmax pooling for ratio > 1, a projection for ratio 1."""

from __future__ import annotations

import torch
from torch import nn

from dsv4flash.config import TextConfig
from dsv4flash.model.norm import RMSNorm


class Compressor(nn.Module):
    """Turns every group of `ratio` tokens into one latent of `head_dim` lanes (before RoPE).

    Ratio > 1: channel-wise softmax over the group of `wgate` scores weights the `wkv` values, in fp32.
    Ratio 1 (the CED source, layer 20): `norm(wkv(x))` with no gate. A trailing incomplete group yields
    nothing; there is no overlap between groups and no absolute position embedding.
    """

    def __init__(self, text: TextConfig, ratio: int, dtype, device) -> None:
        super().__init__()
        self.ratio = ratio
        # REF keeps the ratio>1 compressor in fp32; ratio 1 stays in the activation dtype.
        proj_dtype = torch.float32 if ratio > 1 else dtype
        self.wkv = nn.Linear(text.hidden_size, text.head_dim, bias=False, dtype=proj_dtype, device=device)
        self.wgate = (nn.Linear(text.hidden_size, text.head_dim, bias=False, dtype=proj_dtype, device=device)
                      if ratio > 1 else None)
        self.norm = RMSNorm(text.head_dim, text.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B,S,D] -> latents [B, S//ratio, head_dim] in x's dtype."""
        if self.ratio == 1:
            return self.norm(self.wkv(x.to(self.wkv.weight.dtype)).to(x.dtype))
        batch, seq, _ = x.shape
        groups = seq // self.ratio
        x32 = x[:, : groups * self.ratio].float()
        values = self.wkv(x32).unflatten(1, (groups, self.ratio))  # [B,T,r,hd]
        scores = self.wgate(x32).unflatten(1, (groups, self.ratio))  # [B,T,r,hd]
        pooled = (torch.softmax(scores, dim=2) * values).sum(dim=2)  # [B,T,hd]
        return self.norm(pooled.to(x.dtype))
