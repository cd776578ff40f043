"""Context-parallel collectives of the CSA2 layers, with the gradients each one needs.

- `all_gather_autograd`: the halo exchange. Every rank contributes the tails of its spans and reads the
  tail that precedes each of its own spans; the backward sums every rank's gradient for a tail and returns
  it to the tail's owner, so a window key or a compressor input used across the boundary is trained by
  both sides.
- `all_reduce_sum_autograd`: assembles the global compressed KV / index keys from disjointly owned entries
  (each rank fills only its own groups, zeros elsewhere). Every rank consumes the sum with its own queries,
  so the backward is again a sum over ranks: the owner receives the gradient of every consumer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_autograd", "all_gather_tensors", "all_reduce_sum_autograd"]


def all_gather_tensors(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """[...] on every rank -> [world, ...] (no autograd; for integer bookkeeping such as token ids)."""
    world = dist.get_world_size(group)
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return torch.stack(out)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        return all_gather_tensors(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_gather_autograd(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """[...] on every rank -> [world, ...]; backward: the summed gradient of slot r goes back to rank r."""
    return _AllGather.apply(tensor, group)


def all_reduce_sum_autograd(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum over ranks; backward sums the ranks' gradients (every rank consumes the result differently)."""
    return _AllReduceSum.apply(tensor, group)
