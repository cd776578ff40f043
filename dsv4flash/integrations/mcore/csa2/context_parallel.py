"""Context parallelism of the CSA2 layers: how ranks split a sequence, the halo exchange, the collectives.

A rank holds spans of the global token axis: megatron-core's zigzag split or contiguous pieces of a row,
and for a THD-packed row megatron-core's per-document zigzag (`get_batch_on_this_cp_rank` with
`cu_seqlens`) or contiguous pieces of the packed row. Before each span it needs up to `halo` tokens of the
same sequence held elsewhere: window keys (window − 1), the earlier members of a compression group that
straddles the boundary (ratio − 1) and n-gram context for Engram (max n − 1). A halo may reach over several
short spans on several ranks; every rank computes every rank's halo from the split alone and all-gathers
what is needed from it. A compression group belongs to the rank holding its last token, and the global
compressed KV / index keys are the sum of the owners' zero-padded contributions.

Collectives and their gradients:

- `all_gather_autograd` (the halo): the backward sums every rank's gradient for a sent token and returns
  it to the token's owner, so a key or compressor input used across the boundary is trained by both sides;
- `all_reduce_sum_autograd` (the compressed KV): every rank consumes the sum with its own queries, so the
  backward is again a sum over ranks — the owner receives every consumer's gradient.

Every rank runs the same ops in the same order (the halo is one gather + one `index_select` everywhere),
so the backward collectives line up across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["CP_LAYOUTS", "CPSpans", "HaloPlan", "cp_token_positions", "cp_packed_positions", "all_gather_autograd",
           "all_gather_tensors", "all_reduce_sum_autograd"]

CP_LAYOUTS = ("zigzag", "contiguous")


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
    """How a context-parallel group splits the global token axis: rank r holds the spans `spans[r]`.

    A span is (global start, length); a rank's local tokens are its spans in order. Spans of one rank may
    differ in length (per-document zigzag of a packed batch).
    """

    size: int
    rank: int
    spans: tuple[tuple[tuple[int, int], ...], ...]  # spans[r] = ((start, length), ...) of rank r, local order
    group: Any = None  # the CP process group (None: the default group)

    @classmethod
    def build(cls, layout: str, size: int, rank: int, local_len: int, group: Any = None) -> "CPSpans":
        """'zigzag' = megatron-core's 2·cp chunks (rank r: r and 2cp−1−r); 'contiguous' = one chunk per rank."""
        if layout == "zigzag":
            if local_len % 2:
                raise ValueError(f"zigzag context parallelism needs an even local length, got {local_len}")
            c = local_len // 2
            spans = tuple(((r * c, c), ((2 * size - 1 - r) * c, c)) for r in range(size))
        elif layout == "contiguous":
            spans = tuple(((r * local_len, local_len),) for r in range(size))
        else:
            raise ValueError(f"unknown context-parallel layout {layout!r} (expected one of {CP_LAYOUTS})")
        return cls(size=size, rank=rank, spans=spans, group=group)

    @classmethod
    def build_packed(cls, layout: str, size: int, rank: int, local_len: int, slot_bounds: Sequence[int],
                     group: Any = None) -> "CPSpans":
        """Split of a THD-packed row whose documents occupy the slots [bounds[k], bounds[k+1]).

        'zigzag' is megatron-core's per-document split (`get_batch_on_this_cp_rank` with `cu_seqlens`, i.e.
        Transformer Engine's `thd_get_partitioned_indices`): every document's slots are cut into 2·cp chunks
        and rank r holds chunks r and 2cp−1−r of each document. 'contiguous' cuts the packed row into cp
        equal pieces.
        """
        bounds = [int(b) for b in slot_bounds]
        total = local_len * size
        if bounds[-1] != total:
            raise ValueError(f"packed_seq_params: the padded sequence slots end at {bounds[-1]} but the {size} "
                             f"context-parallel ranks hold {total} tokens ({local_len} each)")
        if layout == "contiguous":
            return cls.build("contiguous", size, rank, local_len, group)
        if layout != "zigzag":
            raise ValueError(f"unknown context-parallel layout {layout!r} (expected one of {CP_LAYOUTS})")
        per_rank: list[list[tuple[int, int]]] = [[] for _ in range(size)]
        for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if (hi - lo) % (2 * size):
                raise ValueError(f"packed_seq_params.cu_seqlens_q_padded: document {k} has {hi - lo} slots; "
                                 f"per-document zigzag over {size} context-parallel ranks needs a multiple of "
                                 f"{2 * size} (pad each document's slots)")
            c = (hi - lo) // (2 * size)
            if c == 0:
                continue
            for r in range(size):
                per_rank[r] += [(lo + r * c, c), (lo + (2 * size - 1 - r) * c, c)]
        return cls(size=size, rank=rank, spans=tuple(tuple(s) for s in per_rank), group=group)

    @property
    def global_len(self) -> int:
        """Length of the whole (unsharded) token axis."""
        return sum(n for rank in self.spans for _, n in rank)

    def positions(self, rank: Optional[int] = None) -> torch.Tensor:
        """Global positions [S_local] of a rank's tokens, in local order."""
        rank = self.rank if rank is None else rank
        parts = [torch.arange(s, s + n) for s, n in self.spans[rank]]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class HaloPlan:
    """Which other ranks' tokens this rank reads (its halo), and where every token sits on its extended axis.

    The extended axis is the sorted union of this rank's global positions and the `width` positions before
    each of its spans (same sequence only), so each global token appears once and a window or compression
    group is contiguous on it. Every rank can compute every rank's halo from the split alone, so each rank
    sends the tokens anybody needs from it (`send_index`, padded to the same count everywhere), all ranks
    all-gather them, and `ext_index` picks the extended axis from [gathered (cp·M) ‖ local tokens (S)]. The
    autograd graph then has the same collectives in the same order on every rank.
    """

    cp: CPSpans
    width: int  # tokens of halo before every span
    send_index: torch.Tensor  # [M] local indices this rank sends (padded with 0)
    ext_index: torch.Tensor  # [E] index into [all ranks' sends (cp·M) ‖ local tokens (S)]
    ext_positions: torch.Tensor  # [E] global position of every extended-axis slot
    local_slots: torch.Tensor  # [S] extended-axis slot of every local token

    @classmethod
    def build(cls, cp: CPSpans, width: int, slot_seq: Optional[torch.Tensor] = None) -> "HaloPlan":
        """The plan for `cp.rank`; slot_seq [T] (global sequence id per slot, −1 = padding) limits halos to
        the span's own sequence (packed rows), None = one sequence per row."""
        owner = torch.full((cp.global_len,), -1, dtype=torch.long)
        local_index = torch.zeros(cp.global_len, dtype=torch.long)
        for r in range(cp.size):
            pos = cp.positions(r)
            owner[pos] = r
            local_index[pos] = torch.arange(pos.numel())

        def halo(r: int) -> torch.Tensor:
            needed = torch.zeros(cp.global_len, dtype=torch.bool)
            for start, _ in cp.spans[r]:
                lo = max(0, start - width)
                if slot_seq is not None:
                    seq_id = int(slot_seq[start])
                    if seq_id < 0:
                        continue
                    window = torch.arange(lo, start)
                    needed[window[slot_seq[lo:start] == seq_id]] = True
                else:
                    needed[lo:start] = True
            needed &= owner != r
            return needed.nonzero().flatten()

        halos = [halo(r) for r in range(cp.size)]
        wanted = torch.cat(halos) if halos else torch.zeros(0, dtype=torch.long)
        sends = [torch.unique(wanted[owner[wanted] == q]) for q in range(cp.size)]  # sorted global positions
        width_m = max((s.numel() for s in sends), default=0)
        mine = sends[cp.rank]
        send_index = torch.zeros(width_m, dtype=torch.long)
        send_index[:mine.numel()] = local_index[mine]
        slot_in_send = torch.zeros(cp.global_len, dtype=torch.long)
        for q, s in enumerate(sends):
            slot_in_send[s] = q * width_m + torch.arange(s.numel())
        local = cp.positions()
        ext_positions = torch.sort(torch.cat([local, halos[cp.rank]])).values
        is_local = owner[ext_positions] == cp.rank
        ext_index = torch.where(is_local, cp.size * width_m + local_index[ext_positions],
                                slot_in_send[ext_positions])
        slot_of = torch.zeros(cp.global_len, dtype=torch.long)
        slot_of[ext_positions] = torch.arange(ext_positions.numel())
        return cls(cp=cp, width=width, send_index=send_index, ext_index=ext_index, ext_positions=ext_positions,
                   local_slots=slot_of[local])

    def to(self, device) -> "HaloPlan":
        """The same plan with its index tensors on `device`."""
        return HaloPlan(cp=self.cp, width=self.width, send_index=self.send_index.to(device),
                        ext_index=self.ext_index.to(device), ext_positions=self.ext_positions.to(device),
                        local_slots=self.local_slots.to(device))

    @property
    def halo_tokens(self) -> int:
        """Tokens this rank receives from other ranks per extended tensor (what crosses ranks)."""
        return int(self.ext_index.numel() - self.local_slots.numel())

    def extend(self, local: torch.Tensor, differentiable: bool = True) -> torch.Tensor:
        """[B, S, ...] -> [B, E, ...]: every rank gathers what the others need from it, then builds its axis."""
        sent = local.index_select(1, self.send_index).movedim(1, 0)  # [M, B, ...]
        gather = all_gather_autograd if differentiable else all_gather_tensors
        gathered = gather(sent.contiguous(), self.cp.group)  # [cp, M, B, ...]
        received = gathered.flatten(0, 1).movedim(0, 1)  # [B, cp·M, ...]
        return torch.cat([received, local], dim=1).index_select(1, self.ext_index)


def cp_token_positions(cp: CPSpans, batch: int, seq_len: int, valid: torch.Tensor, halo_width: int, device):
    """Local and extended-axis positions of a CP rank's unpacked rows (padding: a suffix of each global row).

    Returns (seq, pos, ext_seq, ext_pos, HaloPlan, local_slots, per-row sequence lengths).
    """
    if seq_len != cp.positions().numel():
        raise ValueError(f"context parallel: local length {seq_len} does not match the {cp.size}-rank split")
    pos = cp.positions().to(device).expand(batch, seq_len).contiguous()
    last = torch.where(valid, pos + 1, torch.zeros_like(pos)).amax(dim=1)  # [B]
    dist.all_reduce(last, op=dist.ReduceOp.MAX, group=cp.group)
    if bool((valid != (pos < last.unsqueeze(1))).any()):
        raise ValueError("context parallel: padding_mask must mark a suffix of each global row (right padding)")
    seq = torch.where(valid, torch.zeros_like(pos), torch.full_like(pos, -1))
    plan = HaloPlan.build(cp, halo_width).to(device)
    ext_pos = plan.ext_positions.expand(batch, -1).contiguous()
    ext_seq = torch.where(ext_pos < last.unsqueeze(1), torch.zeros_like(ext_pos), torch.full_like(ext_pos, -1))
    lengths = [[int(n)] for n in last.tolist()]
    return seq, pos, ext_seq, ext_pos, plan, plan.local_slots, lengths


def cp_packed_positions(cp: CPSpans, slot_seq: torch.Tensor, slot_pos: torch.Tensor, halo_width: int, device):
    """Local and extended-axis sequence ids / positions of a CP rank's share of one THD-packed row.

    slot_seq / slot_pos [T]: every global slot's sequence id (−1 = padding) and position in its sequence.
    Returns (seq, pos, ext_seq, ext_pos, HaloPlan, local_slots) with [1, ·] rows.
    """
    plan = HaloPlan.build(cp, halo_width, slot_seq).to(device)
    local = cp.positions().to(device)
    slot_seq, slot_pos = slot_seq.to(device), slot_pos.to(device)
    return (slot_seq[local][None], slot_pos[local][None], slot_seq[plan.ext_positions][None],
            slot_pos[plan.ext_positions][None], plan, plan.local_slots)
