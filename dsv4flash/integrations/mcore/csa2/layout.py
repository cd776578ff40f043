"""Where every token sits, computed once per forward: its sequence, its position, its compression group.

CSA2 attention is defined per sequence (architecture.md §2.3–2.5): the window, the compression groups, RoPE
and the indexer's visibility all count positions from the sequence start, and padding must never enter a
group or a top-k. A micro-batch may be a plain batch (optionally right-padded, `padding_mask` True = pad), a
packed THD batch (`packed_seq_params.cu_seqlens_q[_padded]`) or one context-parallel shard. All three are
reduced to the same description:

- `seq` / `pos` [B, S]: a row-local sequence id (−1 on padding) and the position inside that sequence
  (global under context parallelism);
- the *extended axis* [B, E]: for each local span, the `halo` tokens just before it (owned by another CP
  rank) followed by the span itself, so a window or a compression group never has to look across ranks;
- one `GroupTable` per compress ratio: which groups this rank compresses (a group belongs to the rank that
  holds its last token, so every global KV block has exactly one owner), where their members sit on the
  extended axis, and for every query the first entry of its sequence (`q_base`) and the sequence's entry
  count (`q_count`). Entries of one row are numbered sequence after sequence, group after group.

Everything here is integer bookkeeping: no gradients, closed over by checkpointed chunks. The CP split and
the halo exchange itself live in `context_parallel.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from dsv4flash.integrations.mcore.csa2.context_parallel import (
    CPSpans,
    HaloPlan,
    cp_packed_positions,
    cp_token_positions,
)

__all__ = ["CPSpans", "GroupTable", "TokenLayout", "build_layout"]


@dataclass(frozen=True)
class GroupTable:
    """Compression groups of one ratio on this rank, and each query's view of its sequence's entries."""

    ratio: int
    num_entries: int  # Tmax: entries per row (padded with invalid ones)
    owner_slot: torch.Tensor  # [B, N] extended-axis index of the last member of each group owned here
    owner_valid: torch.Tensor  # [B, N] bool
    owner_entry: torch.Tensor  # [B, N] row entry index of that group
    owner_group: torch.Tensor  # [B, N] group number j inside its sequence (RoPE position j·ratio)
    q_base: torch.Tensor  # [B, S] entry index of the first group of the query's sequence
    q_count: torch.Tensor  # [B, S] number of complete groups of the query's sequence (0 on padding)
    q_reach: torch.Tensor  # [B, S] groups visible to the query: (pos+1)//ratio (0 on padding)

    def visible(self) -> torch.Tensor:
        """[B, S, Tmax] bool: entry e is visible to query (b, s) iff q_base ≤ e < q_base + q_reach."""
        e = torch.arange(self.num_entries, device=self.q_base.device)
        rel = e - self.q_base.unsqueeze(-1)
        return (rel >= 0) & (rel < self.q_reach.unsqueeze(-1))

    def members(self) -> torch.Tensor:
        """[B, N, ratio] extended-axis slots of every owned group's members (clamped for invalid rows)."""
        offsets = torch.arange(1 - self.ratio, 1, device=self.owner_slot.device)
        return (self.owner_slot.unsqueeze(-1) + offsets).clamp(min=0)


@dataclass(frozen=True)
class TokenLayout:
    """Per-forward token bookkeeping shared by every CSA2 layer (see the module docstring)."""

    seq: torch.Tensor  # [B, S] int64, −1 on padding
    pos: torch.Tensor  # [B, S] int64
    ext_seq: torch.Tensor  # [B, E]
    ext_pos: torch.Tensor  # [B, E]
    local_slots: torch.Tensor  # [S] extended-axis index of each local token
    halo: Optional[HaloPlan]
    groups: dict[int, GroupTable] = field(default_factory=dict)

    @property
    def valid(self) -> torch.Tensor:
        """[B, S] bool: real (non-padding) tokens."""
        return self.seq >= 0

    def window_mask(self, window: int) -> torch.Tensor:
        """[B, S, E] bool: same sequence and 0 ≤ pos_q − pos_k < window (keys on the extended axis)."""
        same = (self.seq.unsqueeze(-1) == self.ext_seq.unsqueeze(1)) & (self.seq.unsqueeze(-1) >= 0)
        delta = self.pos.unsqueeze(-1) - self.ext_pos.unsqueeze(1)
        return same & (delta >= 0) & (delta < window)

    def extend(self, local: torch.Tensor) -> torch.Tensor:
        """Local per-token tensor [B, S, ...] -> [B, E, ...] with the halo spans (differentiable under CP)."""
        return local if self.halo is None else self.halo.extend(local)

    def extend_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Like `extend` for integer tensors (token ids, token types); no autograd."""
        return local if self.halo is None else self.halo.extend(local, differentiable=False)


def _segments_from_padding(valid: torch.Tensor) -> None:
    """Reject padding that is not a suffix of its row (left or interior padding)."""
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("padding_mask must mark a suffix of each row (right padding); pack interior or left "
                         "padding as THD with packed_seq_params instead")


def _packed_segments(batch: int, seq_len: int, packed_seq_params: Any, device) -> tuple[torch.Tensor, torch.Tensor]:
    """seq/pos [1, T] from THD `cu_seqlens_q` (real lengths) and `cu_seqlens_q_padded` (slot starts)."""
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"packed_seq_params.qkv_format must be 'thd' for the CSA2 stack, got {fmt!r}")
    if batch != 1:
        raise ValueError(f"packed (THD) input must have micro-batch 1 (hidden [T, 1, H]), got batch {batch}")
    cu = packed_seq_params.cu_seqlens_q
    if cu is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required for THD input")
    cu = [int(v) for v in cu.tolist()]
    padded = packed_seq_params.cu_seqlens_q_padded
    starts = [int(v) for v in padded.tolist()][:-1] if padded is not None else cu[:-1]
    seq = torch.full((1, seq_len), -1, dtype=torch.long)
    pos = torch.zeros((1, seq_len), dtype=torch.long)
    end_prev = 0
    for k, start in enumerate(starts):
        length = cu[k + 1] - cu[k]
        if length < 0 or start < end_prev or start + length > seq_len:
            raise ValueError(f"packed_seq_params: sequence {k} (start {start}, length {length}) does not fit "
                             f"the {seq_len} packed tokens or overlaps the previous sequence")
        seq[0, start:start + length] = k
        pos[0, start:start + length] = torch.arange(length)
        end_prev = start + length
    return seq.to(device), pos.to(device)


def _group_table(ratio: int, seq: torch.Tensor, pos: torch.Tensor, ext_seq: torch.Tensor, ext_pos: torch.Tensor,
                 ext_local: torch.Tensor, lengths: Sequence[Sequence[int]]) -> GroupTable:
    """Entries of every row (sequence after sequence), the groups owned here, and each query's entry range."""
    batch = seq.shape[0]
    device = seq.device
    n_seq = max(1, max(len(row) for row in lengths))
    counts = torch.zeros(batch, n_seq, dtype=torch.long)
    for b, row in enumerate(lengths):
        for k, length in enumerate(row):
            counts[b, k] = length // ratio
    bases = torch.cumsum(counts, dim=1) - counts
    num_entries = int(counts.sum(dim=1).max())
    counts, bases = counts.to(device), bases.to(device)

    def lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Per-sequence value of each token's sequence (0 on padding)."""
        return torch.where(ids >= 0, table.gather(1, ids.clamp(min=0)), torch.zeros_like(ids))

    q_count = lookup(counts, seq)
    q_base = lookup(bases, seq)
    q_reach = torch.where(seq >= 0, torch.div(pos + 1, ratio, rounding_mode="floor"), torch.zeros_like(pos))
    # A group is owned by the rank holding its last member (position ≡ ratio − 1), halo slots excluded.
    owned = ext_local.unsqueeze(0) & (ext_seq >= 0) & (ext_pos % ratio == ratio - 1)
    per_row = owned.sum(dim=1)
    n_owned = int(per_row.max()) if owned.numel() else 0
    order = torch.argsort((~owned).to(torch.int8), dim=1, stable=True)[:, :n_owned]  # owned slots first, in order
    owner_valid = torch.arange(n_owned, device=device).unsqueeze(0) < per_row.unsqueeze(1)
    group = torch.div(ext_pos.gather(1, order), ratio, rounding_mode="floor")
    entry = lookup(bases, ext_seq.gather(1, order)) + group
    zeros = torch.zeros_like(order)
    return GroupTable(
        ratio=ratio,
        num_entries=num_entries,
        owner_slot=torch.where(owner_valid, order, zeros),
        owner_valid=owner_valid,
        owner_entry=torch.where(owner_valid, entry, zeros),
        owner_group=torch.where(owner_valid, group, zeros),
        q_base=q_base,
        q_count=q_count,
        q_reach=q_reach,
    )


@torch.no_grad()
def build_layout(batch: int, seq_len: int, ratios: Sequence[int], *, halo_width: int = 0,
                 padding_mask: Optional[torch.Tensor] = None, packed_seq_params: Any = None,
                 cp: Optional[CPSpans] = None, device=None) -> TokenLayout:
    """Describe a micro-batch of `batch` rows × `seq_len` local tokens (see the module docstring).

    padding_mask: [B, S] bool, True = padding (megatron-core 0.19's convention), a suffix of each row.
    packed_seq_params: THD packing (micro-batch 1; under CP it describes the global row). cp: the
    context-parallel split (`CPSpans.build` for rows, `CPSpans.build_packed` for a packed row).
    halo_width: tokens each CP span needs from before its start (window − 1, ratio − 1, n-gram − 1).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if padding_mask is not None:
        if tuple(padding_mask.shape) != (batch, seq_len):
            raise ValueError(f"padding_mask must be [b, s] = [{batch}, {seq_len}], got {list(padding_mask.shape)}")
        valid = ~padding_mask.to(device=device, dtype=torch.bool)
    else:
        valid = torch.ones(batch, seq_len, dtype=torch.bool, device=device)

    if packed_seq_params is not None:
        if cp is not None:
            return _packed_cp_layout(batch, ratios, halo_width, padding_mask, packed_seq_params, cp, device)
        seq, pos = _packed_segments(batch, seq_len, packed_seq_params, device)
        seq = torch.where(valid, seq, torch.full_like(seq, -1))
        for k in range(int(seq.max()) + 1 if seq.numel() else 0):
            members = pos[seq == k]
            if members.numel() and int(members.max()) + 1 != members.numel():
                raise ValueError(f"padding_mask pads the inside of packed sequence {k}; only whole padding "
                                 "slots between sequences may be masked")
        lengths = [[int((seq[0] == k).sum()) for k in range(int(seq.max()) + 1)]] if bool((seq >= 0).any()) else [[]]
        return _finish(seq, pos, seq, pos, None, ratios, lengths, device)

    if cp is None:
        _segments_from_padding(valid)
        pos = torch.arange(seq_len, device=device).expand(batch, seq_len).contiguous()
        seq = torch.where(valid, torch.zeros_like(pos), torch.full_like(pos, -1))
        lengths = [[int(n)] for n in valid.sum(dim=1).tolist()]
        return _finish(seq, pos, seq, pos, None, ratios, lengths, device)

    seq, pos, ext_seq, ext_pos, plan, local_slots, lengths = cp_token_positions(cp, batch, seq_len, valid,
                                                                                halo_width, device)
    return _finish(seq, pos, ext_seq, ext_pos, plan, ratios, lengths, device, local_slots=local_slots)


def _packed_cp_layout(batch: int, ratios: Sequence[int], halo_width: int, padding_mask: Optional[torch.Tensor],
                      packed_seq_params: Any, cp: CPSpans, device) -> TokenLayout:
    """One CP rank's share of a THD-packed row: `packed_seq_params` describes the whole (global) row, as
    megatron-core passes it to every CP rank; `cp` is the row split (`CPSpans.build_packed`)."""
    slot_seq, slot_pos = _packed_segments(batch, cp.global_len, packed_seq_params, torch.device("cpu"))
    slot_seq, slot_pos = slot_seq[0], slot_pos[0]
    seq, pos, ext_seq, ext_pos, plan, local_slots = cp_packed_positions(cp, slot_seq, slot_pos, halo_width, device)
    if padding_mask is not None and bool((padding_mask.to(device=device, dtype=torch.bool) != (seq < 0)).any()):
        raise ValueError("padding_mask under context parallelism with packed sequences must mark exactly the "
                         "padding slots of packed_seq_params (cu_seqlens_q vs cu_seqlens_q_padded)")
    n_seq = int(slot_seq.max()) + 1 if bool((slot_seq >= 0).any()) else 0
    lengths = [[int((slot_seq == k).sum()) for k in range(n_seq)]]
    return _finish(seq, pos, ext_seq, ext_pos, plan, ratios, lengths, device, local_slots=local_slots)


def _finish(seq, pos, ext_seq, ext_pos, halo, ratios, lengths, device, local_slots=None) -> TokenLayout:
    if local_slots is None:
        local_slots = torch.arange(seq.shape[1], device=device)
    ext_local = torch.zeros(ext_seq.shape[1], dtype=torch.bool, device=device)
    ext_local[local_slots] = True
    groups = {r: _group_table(r, seq, pos, ext_seq, ext_pos, ext_local, lengths) for r in sorted(set(ratios)) if r}
    return TokenLayout(seq=seq, pos=pos, ext_seq=ext_seq, ext_pos=ext_pos, local_slots=local_slots, halo=halo,
                       groups=groups)
