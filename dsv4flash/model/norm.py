"""RMSNorm as the release computes it: in fp32, weight applied after normalisation, cast back."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight · x · rsqrt(mean(x²) + eps)`, computed in fp32 and returned in the input dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * out).to(x.dtype)
