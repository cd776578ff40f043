"""Vision tower (ViT with 2D rotate-half RoPE) and the 3×3 aligner into the text width (docs/architecture.md §7).

One image at a time: the ViT attends bidirectionally over that image's patches only, and the aligner folds
each 3×3 patch neighbourhood into one LLM token. Parameter names follow the release (`vision.*`, `aligner.*`
once the model mounts them). Norm weights are fp32 whatever `dtype` is (REF allocates them in fp32).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsv4flash.config import DSV41FlashConfig
from dsv4flash.model.norm import RMSNorm

__all__ = [
    "VisionTower", "Aligner", "VisionBlock", "VisionAttention", "VisionMLP", "PatchEmbed",
    "rope2d_angles", "apply_rope2d", "merge_neighbourhoods", "encode_images",
]


class _ImageLike(Protocol):
    patches: torch.Tensor
    grid_hw: tuple[int, int]


def rope2d_angles(n_h: int, n_w: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Angles [n_h*n_w, head_dim/2] in fp32: per patch (row-major), [h·inv_freq, w·inv_freq].

    rope_dim = head_dim/2 and inv_freq_k = theta^(-2k/rope_dim), k < rope_dim/2, so each axis gets a quarter
    of the head's lanes worth of frequencies.
    """
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {head_dim}")
    rope_dim = head_dim // 2
    # 1/θ^x rather than θ^-x: the same rounding as REF's table.
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    rows = torch.arange(n_h, dtype=torch.float32, device=device).repeat_interleave(n_w)  # [N]
    cols = torch.arange(n_w, dtype=torch.float32, device=device).repeat(n_h)  # [N]
    return torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)  # [N, rope_dim]


def apply_rope2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate-half on the full head: x [N, H, hd], angles [N, hd/2] -> [N, H, hd], computed in fp32."""
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # [N, 1, hd/2]
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    """Linear(3·p·p -> hidden) with bias; the release has no convolution here."""

    def __init__(self, in_dim: int, hidden: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, hidden, bias=True, dtype=dtype, device=device)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, 3·p·p] (or [N, 3, p, p]) -> [N, hidden]."""
        return self.proj(patches.flatten(1).to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches, 2D RoPE on q and k, default scale."""

    def __init__(self, hidden: int, n_heads: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = hidden // n_heads
        self.wqkv = nn.Linear(hidden, 3 * hidden, bias=True, dtype=dtype, device=device)
        self.wo = nn.Linear(hidden, hidden, bias=True, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], angles [N, head_dim/2] -> [N, hidden]."""
        n = x.shape[0]
        q, k, v = (t.reshape(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = apply_rope2d(q, angles), apply_rope2d(k, angles)  # [N, H, hd]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [H, N, hd]
        return self.wo(o.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU: w2(silu(g)·u) with (g, u) = chunk(w1(x)); no biases, no clamp."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, 2 * inter, bias=False, dtype=dtype, device=device)  # rows: gate ‖ up
        self.w2 = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    """Pre-norm block: x += attn(norm1(x)); x += mlp(norm2(x)); RMSNorm eps 1e-6 with fp32 weights."""

    def __init__(self, cfg: DSV41FlashConfig, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        v = cfg.vision
        self.norm1 = RMSNorm(v.hidden_size, v.rms_norm_eps, dtype=torch.float32, device=device)
        self.attn = VisionAttention(v.hidden_size, v.num_attention_heads, dtype, device)
        self.norm2 = RMSNorm(v.hidden_size, v.rms_norm_eps, dtype=torch.float32, device=device)
        self.mlp = VisionMLP(v.hidden_size, v.intermediate_size, dtype, device)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        x = x + self.attn(self.norm1(x), angles)
        return x + self.mlp(self.norm2(x))


def _init_linears(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class VisionTower(nn.Module):
    """ViT: patch_embed -> blocks -> norm, over one image's row-major patch grid (mounted as `vision.`).

    Fresh init (the release ships none): Linear weights ~ N(0, text initializer_range), biases 0, norms 1.
    """

    def __init__(self, cfg: DSV41FlashConfig, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        v = cfg.vision
        if not v.enabled:
            raise ValueError("VisionTower: vision_config.num_hidden_layers is 0 (this config has no vision tower)")
        self.patch_size = v.patch_size
        self.head_dim = v.head_dim
        self.rope_theta = float(v.rope_theta)
        self.init_std = cfg.text.initializer_range
        self.patch_embed = PatchEmbed(3 * v.patch_size ** 2, v.hidden_size, dtype, device)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype, device) for _ in range(v.num_hidden_layers))
        self.norm = RMSNorm(v.hidden_size, v.rms_norm_eps, dtype=torch.float32, device=device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fresh init; a no-op on the meta device."""
        _init_linears(self, self.init_std)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, patches: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """patches [n_h*n_w, 3·p·p] (row-major grid, channel-major patch) -> features [n_h*n_w, hidden]."""
        n_h, n_w = (int(g) for g in grid_hw)
        in_dim = 3 * self.patch_size ** 2
        if patches.shape[0] != n_h * n_w or patches[0].numel() != in_dim:
            raise ValueError(f"VisionTower: patches must be [{n_h}*{n_w}={n_h * n_w}, {in_dim}] for grid "
                             f"{(n_h, n_w)}, got {list(patches.shape)}")
        x = self.patch_embed(patches)  # [N, hidden]
        angles = rope2d_angles(n_h, n_w, self.head_dim, self.rope_theta, device=x.device)  # [N, hd/2]
        for block in self.blocks:
            x = block(x, angles)
        return self.norm(x)

    def forward_images(self, images: Sequence[_ImageLike]) -> list[torch.Tensor]:
        """Each image separately (attention never crosses images) -> list of [n_h*n_w, hidden]."""
        return [self(img.patches.to(self.patch_embed.proj.weight.device), img.grid_hw) for img in images]


def merge_neighbourhoods(features: torch.Tensor, grid_hw: tuple[int, int], ratio: int, hidden: int) -> torch.Tensor:
    """features [n_h*n_w, hidden] -> cells [H'*W', hidden·r²], lane c·r² + kh·r + kw, zero-padded edges."""
    n_h, n_w = (int(g) for g in grid_hw)
    if tuple(features.shape) != (n_h * n_w, hidden):
        raise ValueError(f"Aligner: features must be [{n_h * n_w}, {hidden}] for grid {(n_h, n_w)}, "
                         f"got {list(features.shape)}")
    r = ratio
    grid = features.reshape(n_h, n_w, hidden).permute(2, 0, 1)  # [C, n_h, n_w]
    grid = F.pad(grid, (0, -n_w % r, 0, -n_h % r))  # zeros right and bottom
    cells = F.unfold(grid.unsqueeze(0), kernel_size=r, stride=r)  # [1, C·r·r, H'·W']
    return cells.squeeze(0).transpose(0, 1)  # [H'·W', C·r·r]


class Aligner(nn.Module):
    """3×3 neighbourhood merge: zero-pad to multiples of 3, unfold (c·9 + kh·3 + kw), w2(GELU(w1(·))).

    Fresh init: weights ~ N(0, initializer_range), biases 0 (mounted as `aligner.`).
    """

    def __init__(self, cfg: DSV41FlashConfig, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        v = cfg.vision
        self.ratio = v.downsample_ratio
        self.hidden = v.hidden_size
        self.init_std = cfg.text.initializer_range
        self.w1 = nn.Linear(v.hidden_size * self.ratio ** 2, cfg.text.hidden_size, bias=True, dtype=dtype,
                            device=device)
        self.w2 = nn.Linear(cfg.text.hidden_size, cfg.text.hidden_size, bias=True, dtype=dtype, device=device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fresh init; a no-op on the meta device."""
        _init_linears(self, self.init_std)

    def llm_grid(self, grid_hw: tuple[int, int]) -> tuple[int, int]:
        """(H', W') = ceil(n_h/3), ceil(n_w/3): the token grid this aligner makes from a patch grid."""
        n_h, n_w = grid_hw
        return -(-n_h // self.ratio), -(-n_w // self.ratio)

    def merge(self, features: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """features [n_h*n_w, hidden] -> cells [H'*W', hidden·r²], lane c·r² + kh·r + kw, zero-padded edges."""
        return merge_neighbourhoods(features, grid_hw, self.ratio, self.hidden)

    def forward(self, features: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """features [n_h*n_w, hidden] -> LLM rows [H'*W', D] in reading order."""
        cells = self.merge(features, grid_hw)  # [H'·W', C·r·r]
        return self.w2(F.gelu(self.w1(cells.to(self.w1.weight.dtype))))  # exact (erf) GELU


def encode_images(tower: VisionTower, aligner: Aligner, images: Sequence[_ImageLike]) -> list[torch.Tensor]:
    """ViT + aligner for each image -> list of LLM rows [H'*W', D], in the order given."""
    return [aligner(feat, img.grid_hw) for feat, img in zip(tower.forward_images(images), images)]
