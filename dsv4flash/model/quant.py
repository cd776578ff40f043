"""Runtime fake-quant points of the training forward (docs/architecture.md §10), straight-through in backward.

Three points are kept: the window KV (FP8 E4M3, 32-lane blocks, power-of-two scale), the compressed KV
(E2M1 values, 16-lane blocks, E4M3 scale) and the index Q/K (E2M1, 32-lane blocks, power-of-two scale).
Without a straight-through backward the compressor's `wgate` would see a zero gradient (§13).

`fake_quant(False)` turns the three points off inside a block: a parity check of two computation orders of the
same function (cached decode against full recompute) runs there, because a code boundary turns a one-ulp
difference of a quantizer's input into a whole E2M1/E4M3 step of its output.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# The E2M1 value grid (magnitudes) and the decision midpoints between neighbouring codes.
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Power-of-two scale 2^ceil(log2(amax/qmax)) from fp32 exponent bits of amax·fp32(1/qmax), as REF."""
    ratio = amax.float() * torch.tensor(1.0 / qmax, dtype=torch.float32)
    bits = ratio.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # round up unless exactly a power of two
    return torch.ldexp(torch.ones_like(ratio), exponent - 127)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to the even code), saturating at ±6."""
    mag = x.abs().clamp(max=E2M1_MAX)
    mids = torch.tensor(_E2M1_MIDS, dtype=mag.dtype, device=mag.device)
    grid = torch.tensor(_E2M1_GRID, dtype=mag.dtype, device=mag.device)
    low = torch.bucketize(mag, mids, right=False)  # a tie goes to the lower code
    high = torch.bucketize(mag, mids, right=True)  # a tie goes to the upper code
    code = torch.where((low != high) & (high % 2 == 0), high, low)
    return torch.copysign(grid[code], x)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"fake-quant block {block} does not divide the last dimension {x.shape[-1]}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _fp8_e4m3_blockwise(x: torch.Tensor, block: int) -> torch.Tensor:
    xb = _blocks(x.float(), block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = pow2_scale(amax, E4M3_MAX)
    q = (xb / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape).to(x.dtype)


def _fp4_e4m3_scaled(x: torch.Tensor, block: int) -> torch.Tensor:
    xb = _blocks(x.float(), block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=E2M1_MAX * 2.0**-9)
    scale = (amax / E2M1_MAX).to(torch.float8_e4m3fn).float()
    return (round_e2m1(xb / scale) * scale).reshape(x.shape).to(x.dtype)


def _fp4_pow2_scaled(x: torch.Tensor, block: int) -> torch.Tensor:
    xb = _blocks(x.float(), block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=E2M1_MAX * 2.0**-126)
    scale = pow2_scale(amax, E2M1_MAX)
    return (round_e2m1(xb / scale) * scale).reshape(x.shape).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: exactly the quantized values. Backward: the incoming gradient passes to x unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
        return quantized

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _straight_through(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    # Not `x + (q - x).detach()`: in bf16 that sum rounds when the quantization error is large (a saturated
    # block gives -2816 where the release's kernel stores -2688), so the forward would not be the release's.
    if not (x.requires_grad and torch.is_grad_enabled()):
        return quantized
    return _StraightThrough.apply(x, quantized)


_enabled = [True]


@contextmanager
def fake_quant(enabled: bool) -> Iterator[None]:
    """Run every fake-quant point (reference and Megatron, all threads) on or off inside the block."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    try:
        yield
    finally:
        _enabled[0] = previous


def fake_quant_window_kv(x: torch.Tensor) -> torch.Tensor:
    """Window KV after RoPE: FP8 E4M3 over 32-lane blocks with UE8M0 scales (all lanes, RoPE tail included)."""
    return _straight_through(x, _fp8_e4m3_blockwise(x.detach(), 32)) if _enabled[0] else x


def fake_quant_compressed_kv(x: torch.Tensor) -> torch.Tensor:
    """Compressed KV after RoPE: E2M1 over 16-lane blocks with an E4M3 scale (NVFP4-style)."""
    return _straight_through(x, _fp4_e4m3_scaled(x.detach(), 16)) if _enabled[0] else x


def fake_quant_index(x: torch.Tensor) -> torch.Tensor:
    """Index Q/K after RoPE: E2M1 over 32-lane blocks with UE8M0 scales (MXFP4)."""
    return _straight_through(x, _fp4_pow2_scaled(x.detach(), 32)) if _enabled[0] else x
