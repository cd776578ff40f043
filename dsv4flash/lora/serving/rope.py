"""Inverse RoPE of the attention output in vLLM's layout, the input the grouped `wo_a` projection consumes.

vLLM keeps one `cos_sin_cache` per attention layer, `[max_positions, rope_dim]` = cos ‖ sin of every
position, and rotates the last `rope_dim` lanes of each head as interleaved pairs (`is_neox_style=False`),
the same pairing as the reference `dsv4flash.model.rope.apply_rope`. The fused kernel that feeds `wo_a`
(`fused_inv_rope_fp8_quant`) undoes that rotation before the projection; the LoRA branch needs the same
un-rotated, unquantised activation.
"""

from __future__ import annotations

import torch


def cos_sin_cache(freqs: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, rope_dim] fp32 = cos(p·f) ‖ sin(p·f) for per-pair frequencies f [rope_dim/2]."""
    angles = torch.arange(max_positions, dtype=torch.float32).unsqueeze(-1) * freqs.float().unsqueeze(0)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def inverse_rope_heads(o: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate the last `rope_dim` lanes of every head back by −θ(pos): o [T, H, hd] -> [T, H, hd] (o's dtype).

    `cache` is vLLM's `[max_positions, rope_dim]` cos ‖ sin table; the math runs in fp32 like the kernel.
    """
    if o.dim() != 3:
        raise ValueError(f"inverse_rope_heads: o must be [T, H, head_dim], got {list(o.shape)}")
    rope_dim = cache.shape[-1]
    if rope_dim % 2 or rope_dim > o.shape[-1]:
        raise ValueError(f"inverse_rope_heads: cos_sin_cache width {rope_dim} must be even and <= head_dim "
                         f"{o.shape[-1]}")
    if positions.shape != o.shape[:1]:
        raise ValueError(f"inverse_rope_heads: positions must be [T={o.shape[0]}], got {list(positions.shape)}")
    half = rope_dim // 2
    cs = cache.index_select(0, positions.long()).float()  # [T, rope_dim]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, rope/2]
    head, tail = o[..., :-rope_dim], o[..., -rope_dim:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]  # [T, H, rope/2]
    # (e + i·o)·(cos − i·sin): the conjugate rotation, as the fused kernel computes it
    rot_even = even * cos + odd * sin
    rot_odd = odd * cos - even * sin
    rotated = torch.stack([rot_even, rot_odd], dim=-1).flatten(-2).to(o.dtype)
    return torch.cat([head, rotated], dim=-1)
