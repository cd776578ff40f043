"""Run unchanged fp32 code in float64: the parity tests' way to tell a real discrepancy from fp32 rounding.

The reference and the Megatron model hard-code fp32 in places (the release's fp32 islands, `.float()` before
norms, softmaxes and mHC mixes). Under `float64_compute()` every op that would produce fp32 produces fp64
instead — dtype arguments `torch.float32` become `torch.float64`, `Tensor.float()` becomes `.double()` and the
default dtype is fp64 —
in the forward pass and in custom autograd backwards (megatron-core's recompute runs the forward there).
The code under test is not changed: only its precision is. Two implementations that agree in fp64 to
~1e-12 differ in fp32 only by summation order (amplified where a gradient is a sum of cancelling terms)
and by the fake-quant codes that fp32 noise flips; a structural error (a lost halo, a wrong owner, a
padding slot in a group, a wrong RoPE position) stays O(1) in fp64.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _PromoteFloat32(TorchFunctionMode):
    """Rewrites fp32 dtype arguments (positional or keyword) to fp64 and `.float()` to `.double()`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        return func(*args, **kwargs)


def _pow2_scale_any_dtype(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """`quant.pow2_scale` without its fp32 bit trick: 2^ceil(log2(amax/qmax)) via frexp, exact in any dtype."""
    mantissa, exponent = torch.frexp(amax * (1.0 / qmax))  # ratio = mantissa · 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(mantissa), exponent - (mantissa == 0.5).to(exponent.dtype))


@contextlib.contextmanager
def float64_compute() -> Iterator[None]:
    """Inside the block, models built and run compute in float64 (fake-quant kept, in fp64)."""
    from dsv4flash.model import quant

    backward_apply = torch.autograd.function.BackwardCFunction.apply
    pow2_scale = quant.pow2_scale
    default_dtype = torch.get_default_dtype()

    def apply_promoted(self, *args):
        # The autograd engine does not carry torch-function modes into backward; custom Functions re-enter it.
        with _PromoteFloat32():
            return backward_apply(self, *args)

    torch.autograd.function.BackwardCFunction.apply = apply_promoted
    quant.pow2_scale = _pow2_scale_any_dtype  # reads fp32 exponent bits; an fp64 view would split each value
    torch.set_default_dtype(torch.float64)
    try:
        with _PromoteFloat32():
            yield
    finally:
        torch.autograd.function.BackwardCFunction.apply = backward_apply
        quant.pow2_scale = pow2_scale
        torch.set_default_dtype(default_dtype)


def precision_scope(precision: str):
    """"fp64": `float64_compute()`; "fp32": the code as shipped."""
    if precision not in ("fp32", "fp64"):
        raise ValueError(f"precision must be 'fp32' or 'fp64', got {precision!r}")
    return float64_compute() if precision == "fp64" else contextlib.nullcontext()
