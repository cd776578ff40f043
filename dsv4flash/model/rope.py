"""Text RoPE: interleaved complex pairs on the last `rope_dim` lanes, with YaRN for compressed layers (§11)."""

from __future__ import annotations

import math

import torch

from dsv4flash.config import TextConfig


def rope_frequencies(text: TextConfig, theta: float, yarn: bool) -> torch.Tensor:
    """Per-pair angular frequencies [rope_dim/2] in fp32 (YaRN interpolation only, no mscale)."""
    dim = text.qk_rope_head_dim
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not yarn:
        return freqs
    scaling = text.rope_scaling

    def correction(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (2 * math.pi * rotations)) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction(scaling.beta_fast)), 0)
    high = min(math.ceil(correction(scaling.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freqs / scaling.factor * ramp + freqs * (1 - ramp)


def rope_angles(freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Unit complex rotations `[*positions.shape, rope_dim/2]` for integer positions."""
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs.to(positions.device)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `2·rotation.shape[-1]` lanes of x (pairs as complex numbers), in fp32, cast back.

    x: [B,S,width] or [B,S,heads,width]; rotation: [S, rope_dim/2] or [B,S, rope_dim/2].
    """
    rope_dim = rotation.shape[-1] * 2
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = torch.view_as_complex(tail.float().reshape(*tail.shape[:-1], rope_dim // 2, 2).contiguous())
    rot = rotation.conj() if inverse else rotation
    if x.dim() == 4:
        rot = rot.unsqueeze(-2)  # broadcast over the heads axis
    rotated = torch.view_as_real(pairs * rot).reshape(tail.shape).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)
