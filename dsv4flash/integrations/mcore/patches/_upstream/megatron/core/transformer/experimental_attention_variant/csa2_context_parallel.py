# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""CSA2 token layouts for THD-packed sequences and for context parallelism.

THD packing: ``packed_seq_params.cu_seqlens_q`` gives the real sequence lengths and
``cu_seqlens_q_padded`` (if set) where each sequence's slots start; slots past a sequence's real
length are padding. Every window, compression group and top-k stays inside its own sequence.

Right-padded rows: ``padding_mask`` [b, s] (True = padding) marks a suffix of each row; padding
tokens belong to no sequence.

Context parallelism: a rank holds spans of the global token axis, as ``get_batch_on_this_cp_rank``
splits it (``cp_split="zigzag"``): 2 * cp chunks of a row, rank r holding chunks r and 2 * cp - 1 - r,
or for a THD-packed row the same per-document split (``cu_seqlens_q_padded`` then describes the global
row, each document padded to a multiple of 2 * cp). ``cp_split="contiguous"`` gives rank r the r-th of
cp equal pieces of the row (or of the packed row), for data loaders that shard that way. Before each span a rank needs up to ``halo`` earlier tokens of the
same sequence held elsewhere (window keys and the first members of a compression group that straddles
the boundary). Every rank computes every rank's halo from the split alone and all-gathers what is
needed, so all ranks run the same collectives in the same order. A compression group belongs to the
rank holding its last token, so every global compressed key has exactly one owner; the compressed
keys of a row are the sum over ranks of the owners' zero-padded contributions.

Gradients: the halo all-gather sums every rank's gradient of a sent token and returns it to the
token's owner, and the compressed-key all-reduce sums every consumer's gradient, so the owner's
compressor is trained by the queries of every rank.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.transformer.experimental_attention_variant.csa2_layout import (
    CSA2GroupTable,
    CSA2TokenLayout,
)

Spans = Tuple[Tuple[int, int], ...]  # (global start, length) of each local chunk, in local order

CP_SPLITS = ("zigzag", "contiguous")


class _AllGather(torch.autograd.Function):
    """[...] on every rank -> [world, ...]; backward returns the summed gradient of slot r to rank r."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        return _all_gather(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; backward sums the ranks' gradients (each rank consumes the sum differently)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return torch.stack(out)


def thd_slots(total: int, packed_seq_params) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sequence id (-1 = padding) and position in its sequence of each of ``total`` packed slots."""
    if getattr(packed_seq_params, "qkv_format", "thd") != "thd":
        raise ValueError(f"CSA2: packed_seq_params.qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}")
    lengths = torch.diff(packed_seq_params.cu_seqlens_q.cpu()).tolist()
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    starts = (padded if padded is not None else packed_seq_params.cu_seqlens_q).cpu().tolist()[:-1]
    seq = torch.full((total,), -1, dtype=torch.long)
    pos = torch.zeros(total, dtype=torch.long)
    end = 0
    for k, (start, length) in enumerate(zip(starts, lengths)):
        if start < end or start + length > total:
            raise ValueError(
                f"CSA2: packed sequence {k} (slots {start}..{start + length}) overlaps the previous one "
                f"or does not fit the {total} packed tokens"
            )
        seq[start : start + length] = k
        pos[start : start + length] = torch.arange(length)
        end = start + length
    return seq, pos


def zigzag_spans(cp_size: int, bounds: Sequence[int]) -> List[Spans]:
    """Spans of every rank: each [bounds[k], bounds[k + 1]) cut into 2 * cp chunks, r and 2cp-1-r."""
    per_rank: List[List[Tuple[int, int]]] = [[] for _ in range(cp_size)]
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if (hi - lo) % (2 * cp_size):
            raise ValueError(
                f"CSA2: sequence {k} has {hi - lo} slots; context parallelism over {cp_size} ranks "
                f"needs a multiple of {2 * cp_size}"
            )
        chunk = (hi - lo) // (2 * cp_size)
        if chunk:
            for r in range(cp_size):
                per_rank[r] += [(lo + r * chunk, chunk), (lo + (2 * cp_size - 1 - r) * chunk, chunk)]
    return [tuple(spans) for spans in per_rank]


def contiguous_spans(cp_size: int, total: int) -> List[Spans]:
    """Spans of every rank: the r-th of ``cp_size`` equal pieces of the ``total`` slots."""
    if total % cp_size:
        raise ValueError(f"CSA2: {total} slots do not split into {cp_size} equal context-parallel pieces")
    piece = total // cp_size
    return [((r * piece, piece),) for r in range(cp_size)]


def cp_spans(cp_size: int, bounds: Sequence[int], cp_split: str = "zigzag") -> List[Spans]:
    """Spans of every rank for ``cp_split`` (see ``CP_SPLITS``); ``bounds`` are the sequences' slot starts."""
    if cp_split == "zigzag":
        return zigzag_spans(cp_size, bounds)
    if cp_split == "contiguous":
        return contiguous_spans(cp_size, bounds[-1])
    raise ValueError(f"CSA2: unknown context-parallel split {cp_split!r} (expected one of {CP_SPLITS})")


def span_positions(spans: Spans) -> torch.Tensor:
    """Global slots [s] of one rank's spans, in local order."""
    parts = [torch.arange(start, start + n) for start, n in spans]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass
class _HaloPlan:
    """What this rank sends, and how it builds its extended axis from [all sends, local tokens]."""

    send_index: torch.Tensor  # [M] local tokens this rank sends (padded with 0)
    ext_index: torch.Tensor  # [E] index into [gathered sends (cp * M), local tokens (s)]
    ext_positions: torch.Tensor  # [E] global slot of every extended-axis entry, sorted
    local_slots: torch.Tensor  # [s] extended-axis entry of every local token


def _halo_plan(spans: List[Spans], rank: int, width: int, slot_seq: torch.Tensor) -> _HaloPlan:
    total = slot_seq.numel()
    owner = torch.full((total,), -1, dtype=torch.long)
    local_index = torch.zeros(total, dtype=torch.long)
    for r, rank_spans in enumerate(spans):
        pos = span_positions(rank_spans)
        owner[pos], local_index[pos] = r, torch.arange(pos.numel())

    def halo(r: int) -> torch.Tensor:
        needed = torch.zeros(total, dtype=torch.bool)
        for start, _ in spans[r]:
            lo = max(0, start - width)
            same = slot_seq[lo:start] == slot_seq[start]
            needed[lo:start] |= same & (slot_seq[start] >= 0)
        return (needed & (owner != r)).nonzero().flatten()

    halos = [halo(r) for r in range(len(spans))]
    wanted = torch.cat(halos)
    sends = [torch.unique(wanted[owner[wanted] == q]) for q in range(len(spans))]
    width_m = max(s.numel() for s in sends)
    send_index = torch.zeros(width_m, dtype=torch.long)
    send_index[: sends[rank].numel()] = local_index[sends[rank]]
    slot_in_send = torch.zeros(total, dtype=torch.long)
    for q, sent in enumerate(sends):
        slot_in_send[sent] = q * width_m + torch.arange(sent.numel())
    local = span_positions(spans[rank])
    ext_positions = torch.sort(torch.cat([local, halos[rank]])).values
    ext_index = torch.where(
        owner[ext_positions] == rank,
        len(spans) * width_m + local_index[ext_positions],
        slot_in_send[ext_positions],
    )
    entry_of = torch.zeros(total, dtype=torch.long)
    entry_of[ext_positions] = torch.arange(ext_positions.numel())
    return _HaloPlan(send_index, ext_index, ext_positions, entry_of[local])


class CSA2PartitionedLayout(CSA2TokenLayout):
    """A context-parallel rank's share of the rows: extends tensors with the halo, sums owners' keys."""

    def __init__(self, plan: _HaloPlan, group, **fields):
        super().__init__(**fields)
        self.plan, self.group = plan, group

    def extend(self, local: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] -> [b, E, ...]: every rank gathers what the others need from it."""
        sent = local.index_select(1, self.plan.send_index).movedim(1, 0)  # [M, b, ...]
        gathered = _AllGather.apply(sent.contiguous(), self.group)  # [cp, M, b, ...]
        received = gathered.flatten(0, 1).movedim(0, 1)  # [b, cp * M, ...]
        return torch.cat([received, local], dim=1).index_select(1, self.plan.ext_index)

    def extend_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Like ``extend``, for integer tensors (token ids): the same exchange without autograd."""
        sent = local.index_select(1, self.plan.send_index).movedim(1, 0)
        received = _all_gather(sent, self.group).flatten(0, 1).movedim(0, 1)
        return torch.cat([received, local], dim=1).index_select(1, self.plan.ext_index)

    @property
    def halo_tokens(self) -> int:
        """Tokens this rank receives from other ranks for every extended tensor."""
        return self.plan.ext_index.numel() - self.plan.local_slots.numel()

    def publish(self, owned: torch.Tensor, table: CSA2GroupTable, differentiable: bool = True):
        """Owned groups [b, N, d] -> every global entry [b, T, d] (the sum of the owners' parts)."""
        mine = super().publish(owned, table)
        if differentiable:
            return _AllReduceSum.apply(mine, self.group)
        mine = mine.contiguous().clone()
        dist.all_reduce(mine, group=self.group)
        return mine


def _suffix_padding(valid: torch.Tensor) -> None:
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError(
            "CSA2: padding_mask must mark a suffix of each row (right padding); pack left or interior "
            "padding as THD with packed_seq_params instead"
        )


def _mask_packed(seq: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, documents: int):
    """Drop the masked slots of a packed row; only each document's tail may be masked."""
    seq = torch.where(valid, seq, torch.full_like(seq, -1))
    lengths = []
    for k in range(documents):
        members = pos[seq == k]
        if members.numel() and int(members.max()) + 1 != members.numel():
            raise ValueError(
                f"CSA2: padding_mask pads the inside of packed sequence {k}; only padding slots and "
                "the tail of a sequence may be masked"
            )
        lengths.append(members.numel())
    return seq, [lengths]


def build_csa2_layout(
    batch: int,
    seq_len: int,
    device,
    halo: int,
    packed_seq_params=None,
    cp_group: Optional[dist.ProcessGroup] = None,
    padding_mask: Optional[torch.Tensor] = None,
    cp_split: str = "zigzag",
) -> CSA2TokenLayout:
    """The layout of a micro-batch of ``batch`` rows x ``seq_len`` local tokens.

    packed_seq_params: THD packing (micro-batch 1; under context parallelism it describes the global
    row). cp_group: the context-parallel group, or None. halo: earlier tokens each span may need
    (window - 1 and the largest compress ratio - 1). padding_mask: [b, s] bool, True = padding, a
    suffix of each (global) row; with packing it may mask padding slots and sequence tails. cp_split:
    how the ranks split the row (``CP_SPLITS``).
    """
    cp = dist.get_world_size(cp_group) if cp_group is not None else 1
    valid = None
    if padding_mask is not None:
        if tuple(padding_mask.shape) != (batch, seq_len):
            raise ValueError(
                f"CSA2: padding_mask must be [b, s] = [{batch}, {seq_len}], got {list(padding_mask.shape)}"
            )
        valid = ~padding_mask.to(device=device, dtype=torch.bool)
    if packed_seq_params is None and cp == 1:
        layout = CSA2TokenLayout.dense(batch, seq_len, device)
        if valid is None:
            return layout
        _suffix_padding(valid)
        seq = torch.where(valid, layout.seq, torch.full_like(layout.seq, -1))
        lengths = [[int(n)] for n in valid.sum(dim=1).tolist()]
        return CSA2TokenLayout(seq, layout.pos, seq, layout.pos, layout.ext_local, lengths)
    total = seq_len * cp
    if packed_seq_params is not None:
        if batch != 1:
            raise ValueError(f"CSA2: packed (THD) input needs micro-batch 1 ([t, 1, h]), got {batch}")
        slot_seq, slot_pos = thd_slots(total, packed_seq_params)
        padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
        bounds = (padded if padded is not None else packed_seq_params.cu_seqlens_q).cpu().tolist()
        lengths = [[int(n) for n in torch.diff(packed_seq_params.cu_seqlens_q.cpu()).tolist()]]
    else:
        slot_seq = torch.zeros(total, dtype=torch.long)
        slot_pos = torch.arange(total)
        bounds = [0, total]
        lengths = [[total] for _ in range(batch)]
    if bounds[-1] != total:
        raise ValueError(
            f"CSA2: packed_seq_params describes {bounds[-1]} slots but the {cp} rank(s) hold {total}"
        )
    if cp == 1:
        local = torch.ones(total, dtype=torch.bool, device=device)
        seq, pos = slot_seq[None].to(device), slot_pos[None].to(device)
        if valid is not None:
            seq, lengths = _mask_packed(seq, pos, valid, len(lengths[0]))
        return CSA2TokenLayout(seq, pos, seq, pos, local, lengths)
    spans = cp_spans(cp, bounds, cp_split)
    rank = dist.get_rank(cp_group)
    plan = _halo_plan(spans, rank, halo, slot_seq)
    mine, ext = span_positions(spans[rank]), plan.ext_positions
    ext_local = torch.zeros(ext.numel(), dtype=torch.bool)
    ext_local[plan.local_slots] = True
    rows = lambda t: t.to(device).expand(batch, -1).contiguous()  # noqa: E731
    plan = _HaloPlan(*(t.to(device) for t in (plan.send_index, plan.ext_index, ext, plan.local_slots)))
    seq, pos, ext_seq, ext_pos = (rows(t) for t in (slot_seq[mine], slot_pos[mine], slot_seq[ext], slot_pos[ext]))
    if valid is not None and packed_seq_params is not None:
        if bool((valid != (seq >= 0)).any()):
            raise ValueError(
                "CSA2: under context parallelism with packed sequences padding_mask must mark exactly "
                "the padding slots of packed_seq_params (cu_seqlens_q vs cu_seqlens_q_padded)"
            )
    elif valid is not None:  # right-padded rows: each row's global length is its last real token + 1
        last = torch.where(valid, pos + 1, torch.zeros_like(pos)).amax(dim=1)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=cp_group)
        if bool((valid != (pos < last.unsqueeze(1))).any()):
            raise ValueError("CSA2: padding_mask must mark a suffix of each global row (right padding)")
        seq = torch.where(valid, seq, torch.full_like(seq, -1))
        ext_seq = torch.where(ext_pos < last.unsqueeze(1), ext_seq, torch.full_like(ext_seq, -1))
        lengths = [[int(n)] for n in last.tolist()]
    return CSA2PartitionedLayout(
        plan,
        cp_group,
        seq=seq,
        pos=pos,
        ext_seq=ext_seq,
        ext_pos=ext_pos,
        ext_local=ext_local.to(device),
        lengths=lengths,
    )
