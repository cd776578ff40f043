"""Context parallelism of the CSA2 layers: how ranks split a sequence, the halo exchange, the collectives.

A rank holds spans of the global sequence (megatron-core's zigzag split, or contiguous halves). Before each
span it needs `halo` tokens owned by another rank: window keys (window − 1), the earlier members of a
compression group that straddles the boundary (ratio − 1) and n-gram context for Engram (max n − 1). Those
travel as span tails; a compression group belongs to the rank holding its last token, and the global
compressed KV / index keys are the sum of the owners' zero-padded contributions.

Collectives and their gradients:

- `all_gather_autograd` (the halo): the backward sums every rank's gradient for a tail and returns it to the
  tail's owner, so a key or compressor input used across the boundary is trained by both sides;
- `all_reduce_sum_autograd` (the compressed KV): every rank consumes the sum with its own queries, so the
  backward is again a sum over ranks — the owner receives every consumer's gradient.

Every rank runs the same ops in the same order (the halo is one gather + one `index_select` everywhere),
so the backward collectives line up across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["CPSpans", "HaloPlan", "cp_token_positions", "all_gather_autograd", "all_gather_tensors",
           "all_reduce_sum_autograd"]


def all_gather_tensors(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """[...] on every rank -> [world, ...] (no autograd; for integer bookkeeping such as token ids)."""
    world = dist.get_world_size(group)
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return torch.stack(out)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        """[...] -> [world, ...]."""
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        return all_gather_tensors(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """Sum every rank's gradient for each slot; keep this rank's slot."""
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        """Sum over ranks."""
        ctx.group = group
        out = tensor.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """Sum of every rank's gradient (each rank consumed the sum differently)."""
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_gather_autograd(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """[...] on every rank -> [world, ...]; backward: the summed gradient of slot r goes back to rank r."""
    return _AllGather.apply(tensor, group)


def all_reduce_sum_autograd(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum over ranks; backward sums the ranks' gradients (every rank consumes the result differently)."""
    return _AllReduceSum.apply(tensor, group)


@dataclass(frozen=True)
class CPSpans:
    """How a context-parallel group splits the global sequence: every rank holds `len(starts[r])` spans."""

    size: int
    rank: int
    span_len: int
    starts: tuple[tuple[int, ...], ...]  # starts[r][i] = global start of rank r's i-th span
    group: Any = None  # the CP process group (None: the default group)

    @classmethod
    def build(cls, layout: str, size: int, rank: int, local_len: int, group: Any = None) -> "CPSpans":
        """'zigzag' = megatron-core's 2·cp chunks (rank r: r and 2cp−1−r); 'contiguous' = one chunk per rank."""
        if layout == "zigzag":
            if local_len % 2:
                raise ValueError(f"zigzag context parallelism needs an even local length, got {local_len}")
            c = local_len // 2
            starts = tuple((r * c, (2 * size - 1 - r) * c) for r in range(size))
        elif layout == "contiguous":
            c = local_len
            starts = tuple((r * c,) for r in range(size))
        else:
            raise ValueError(f"unknown context-parallel layout {layout!r} (expected 'zigzag' or 'contiguous')")
        return cls(size=size, rank=rank, span_len=c, starts=starts, group=group)

    @property
    def global_len(self) -> int:
        """Length of the whole (unsharded) sequence."""
        return self.span_len * sum(len(s) for s in self.starts)

    def positions(self, rank: Optional[int] = None) -> torch.Tensor:
        """Global positions [S_local] of a rank's tokens, in local order."""
        rank = self.rank if rank is None else rank
        return torch.cat([torch.arange(s, s + self.span_len) for s in self.starts[rank]])

    def span_ending_at(self, position: int) -> tuple[int, int]:
        """(rank, span) whose span ends right before global `position`."""
        for r, starts in enumerate(self.starts):
            for i, s in enumerate(starts):
                if s + self.span_len == position:
                    return r, i
        raise ValueError(f"no context-parallel span ends at position {position}")


@dataclass(frozen=True)
class HaloPlan:
    """Which span tails a CP rank reads, and where they go on its extended axis.

    Every rank gathers every rank's span tails and builds its extended axis with one `index_select` from
    [all tails ‖ local tokens]: the autograd graph then has the same shape on every rank, so the gathers'
    backward collectives run in the same order everywhere (a rank that skipped an unused gather would hang).
    """

    cp: CPSpans
    width: int  # tokens of halo before every span that does not start the sequence
    # Per local span: (rank, span) whose tail precedes it, or None (sequence start, or this rank's previous span).
    sources: tuple[Optional[tuple[int, int]], ...]
    ext_index: torch.Tensor  # [E] index into [all tails (cp·spans·width) ‖ local tokens (S)]

    def extend(self, local: torch.Tensor, differentiable: bool = True) -> torch.Tensor:
        """[B, S, ...] -> [B, E, ...]: every rank gathers all span tails, then picks its own halo."""
        c, width = self.cp.span_len, self.width
        spans = local.shape[1] // c
        tails = torch.stack([local[:, i * c + c - width: i * c + c] for i in range(spans)])  # [spans,B,W,...]
        gather = all_gather_autograd if differentiable else all_gather_tensors
        gathered = gather(tails.contiguous(), self.cp.group)  # [cp, spans, B, W, ...]
        tails_all = gathered.movedim(2, 0).flatten(1, 3)  # [B, cp·spans·W, ...]
        return torch.cat([tails_all, local], dim=1).index_select(1, self.ext_index)


def cp_token_positions(cp: CPSpans, batch: int, seq_len: int, valid: torch.Tensor, halo_width: int, device):
    """Local and extended-axis positions of a CP rank's unpacked rows (padding: a suffix of each global row).

    Returns (seq, pos, ext_seq, ext_pos, HaloPlan, local_slots, per-row sequence lengths).
    """
    if seq_len != cp.span_len * len(cp.starts[cp.rank]):
        raise ValueError(f"context parallel: local length {seq_len} does not match the {cp.size}-rank split")
    if halo_width > cp.span_len:
        raise ValueError(f"context parallel: each span holds {cp.span_len} tokens but the CSA2 layers need "
                         f"{halo_width} tokens of halo; use fewer CP ranks or longer sequences")
    pos = cp.positions().to(device).expand(batch, seq_len).contiguous()
    last = torch.where(valid, pos + 1, torch.zeros_like(pos)).amax(dim=1)  # [B]
    dist.all_reduce(last, op=dist.ReduceOp.MAX, group=cp.group)
    if bool((valid != (pos < last.unsqueeze(1))).any()):
        raise ValueError("context parallel: padding_mask must mark a suffix of each global row (right padding)")
    seq = torch.where(valid, torch.zeros_like(pos), torch.full_like(pos, -1))
    sources = tuple(None if s == 0 or cp.span_ending_at(s) == (cp.rank, i - 1) else cp.span_ending_at(s)
                    for i, s in enumerate(cp.starts[cp.rank]))  # no halo after this rank's own previous span
    n_spans, c = len(cp.starts[cp.rank]), cp.span_len
    ext_pos_parts, ext_index, local_slots, offset = [], [], [], 0
    for i, start in enumerate(cp.starts[cp.rank]):
        if sources[i] is not None:
            r, j = sources[i]
            ext_pos_parts.append(torch.arange(start - halo_width, start))
            ext_index.append((r * n_spans + j) * halo_width + torch.arange(halo_width))
            offset += halo_width
        ext_pos_parts.append(torch.arange(start, start + c))
        ext_index.append(cp.size * n_spans * halo_width + i * c + torch.arange(c))
        local_slots.append(torch.arange(offset, offset + c))
        offset += c
    plan = HaloPlan(cp=cp, width=halo_width, sources=sources, ext_index=torch.cat(ext_index).to(device))
    ext_pos = torch.cat(ext_pos_parts).to(device).expand(batch, -1).contiguous()
    ext_seq = torch.where(ext_pos < last.unsqueeze(1), torch.zeros_like(ext_pos), torch.full_like(ext_pos, -1))
    lengths = [[int(n)] for n in last.tolist()]
    return seq, pos, ext_seq, ext_pos, plan, torch.cat(local_slots).to(device), lengths
