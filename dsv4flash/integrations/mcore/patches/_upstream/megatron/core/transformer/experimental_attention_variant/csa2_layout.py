# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Where every token of a CSA2 micro-batch sits: its sequence, its position, its compression groups.

CSA2 attention is defined per sequence: the window, the compression groups, RoPE and the indexer's
visibility all count positions from the start of the token's sequence, and no group or top-k may mix
sequences. ``CSA2TokenLayout`` reduces a micro-batch to that description:

* ``seq`` / ``pos`` [b, s]: a row-local sequence id (-1 on padding) and the position in the sequence;
* the extended axis [b, E]: the keys a rank's queries may read. Here it is the local tokens; a layout
  whose tokens are split over ranks puts the tokens it needs from other ranks before its own spans
  (``extend``), so windows and groups never look across ranks;
* one ``CSA2GroupTable`` per compress ratio: the groups whose last token this rank holds (so every
  compressed key has exactly one owner), their members on the extended axis, and for every query the
  first compressed entry of its sequence, the sequence's entry count and how many entries it sees.
  Compressed entries of a row are numbered sequence after sequence, group after group.

Everything here is integer bookkeeping without gradients.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import torch


@dataclass(frozen=True)
class CSA2GroupTable:
    """Compression groups of one ratio owned by this rank, and each query's view of its entries."""

    ratio: int
    num_entries: int  # T: compressed entries per row
    members: torch.Tensor  # [b, N, ratio] extended-axis slots of every owned group's tokens
    owner_valid: torch.Tensor  # [b, N] bool
    owner_entry: torch.Tensor  # [b, N] row entry of each owned group
    owner_start: torch.Tensor  # [b, N] position of the group's first token (its RoPE position)
    q_base: torch.Tensor  # [b, s] entry of the first group of the query's sequence
    q_count: torch.Tensor  # [b, s] complete groups of the query's sequence (0 on padding)
    q_reach: torch.Tensor  # [b, s] groups the query sees: (pos + 1) // ratio (0 on padding)

    def visible(self) -> torch.Tensor:
        """[b, s, T] bool: entry t is visible to the query iff q_base <= t < q_base + q_reach."""
        rel = torch.arange(self.num_entries, device=self.q_base.device) - self.q_base.unsqueeze(-1)
        return (rel >= 0) & (rel < self.q_reach.unsqueeze(-1))

    def own_columns(self) -> torch.Tensor:
        """[b, s, W] row entries of each query's own sequence, W = the longest sequence's count."""
        width = int(self.q_count.max()) if self.q_count.numel() else 0
        cols = self.q_base.unsqueeze(-1) + torch.arange(width, device=self.q_base.device)
        return cols.clamp(max=max(self.num_entries - 1, 0))

    def own_valid(self, width: int) -> torch.Tensor:
        """[b, s, W] bool: column w exists in the query's sequence."""
        return torch.arange(width, device=self.q_count.device) < self.q_count.unsqueeze(-1)


@dataclass
class CSA2TokenLayout:
    """Per-forward token bookkeeping shared by the CSA2 layers (see the module docstring)."""

    seq: torch.Tensor  # [b, s] int64, -1 on padding
    pos: torch.Tensor  # [b, s] int64
    ext_seq: torch.Tensor  # [b, E]
    ext_pos: torch.Tensor  # [b, E]
    ext_local: torch.Tensor  # [E] bool: the slot holds one of this rank's tokens
    lengths: List[List[int]]  # per row: the length of every sequence, in order
    _groups: Dict[int, CSA2GroupTable] = field(default_factory=dict)

    @classmethod
    def dense(cls, batch: int, seq_len: int, device) -> "CSA2TokenLayout":
        """One whole sequence per row [b, s] on one rank."""
        pos = torch.arange(seq_len, device=device).expand(batch, seq_len)
        seq = torch.zeros_like(pos)
        local = torch.ones(seq_len, dtype=torch.bool, device=device)
        return cls(seq, pos, seq, pos, local, [[seq_len] for _ in range(batch)])

    @property
    def valid(self) -> torch.Tensor:
        """[b, s] bool: real (non-padding) tokens."""
        return self.seq >= 0

    @property
    def local_slots(self) -> torch.Tensor:
        """[s] extended-axis slot of every local token."""
        return self.ext_local.nonzero().flatten()

    def extend(self, local: torch.Tensor) -> torch.Tensor:
        """Local per-token tensor [b, s, ...] -> extended axis [b, E, ...]."""
        return local

    def extend_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Like ``extend``, for integer tensors (token ids) that need no gradient."""
        return local

    def publish(self, owned: torch.Tensor, table: CSA2GroupTable, differentiable: bool = True):
        """Values of the owned groups [b, N, d] -> every row entry [b, T, d] (zero where not owned)."""
        b, _, width = owned.shape
        out = owned.new_zeros(b, table.num_entries, width)
        index = table.owner_entry.unsqueeze(-1).expand(-1, -1, width)
        return out.scatter_add(1, index, owned * table.owner_valid.unsqueeze(-1).to(owned.dtype))

    def window_mask(self, window: int) -> torch.Tensor:
        """[b, s, E] bool: same sequence and 0 <= pos_q - pos_k < window."""
        same = (self.seq.unsqueeze(-1) == self.ext_seq.unsqueeze(1)) & (self.seq.unsqueeze(-1) >= 0)
        delta = self.pos.unsqueeze(-1) - self.ext_pos.unsqueeze(1)
        return same & (delta >= 0) & (delta < window)

    @torch.no_grad()
    def groups(self, ratio: int) -> CSA2GroupTable:
        """The group table of compress ratio ``ratio`` (built once per layout)."""
        if ratio not in self._groups:
            self._groups[ratio] = _group_table(self, ratio)
        return self._groups[ratio]


def _group_table(layout: CSA2TokenLayout, ratio: int) -> CSA2GroupTable:
    seq, pos, ext_seq, ext_pos = layout.seq, layout.pos, layout.ext_seq, layout.ext_pos
    device, batch = seq.device, seq.shape[0]
    rows: Sequence[Sequence[int]] = layout.lengths
    counts = torch.zeros(batch, max(1, max(len(r) for r in rows)), dtype=torch.long)
    for b, row in enumerate(rows):
        for k, length in enumerate(row):
            counts[b, k] = length // ratio
    bases = (torch.cumsum(counts, dim=1) - counts).to(device)
    num_entries = int(counts.sum(dim=1).max())
    counts = counts.to(device)

    def per_sequence(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids >= 0, values.gather(1, ids.clamp(min=0)), torch.zeros_like(ids))

    # A group belongs to the rank holding its last token: position = ratio - 1 (mod ratio).
    owned = layout.ext_local.unsqueeze(0) & (ext_seq >= 0) & (ext_pos % ratio == ratio - 1)
    per_row = owned.sum(dim=1)
    n_owned = int(per_row.max()) if owned.numel() else 0
    last = torch.argsort((~owned).to(torch.int8), dim=1, stable=True)[:, :n_owned]  # [b, N]
    valid = torch.arange(n_owned, device=device).unsqueeze(0) < per_row.unsqueeze(1)
    group = torch.div(ext_pos.gather(1, last), ratio, rounding_mode="floor")
    entry = per_sequence(bases, ext_seq.gather(1, last)) + group
    zeros = torch.zeros_like(last)
    members = last.unsqueeze(-1) + torch.arange(1 - ratio, 1, device=device)  # contiguous on E
    return CSA2GroupTable(
        ratio=ratio,
        num_entries=num_entries,
        members=torch.where(valid.unsqueeze(-1), members, zeros.unsqueeze(-1)).clamp(min=0),
        owner_valid=valid,
        owner_entry=torch.where(valid, entry, zeros),
        owner_start=torch.where(valid, group * ratio, zeros),
        q_base=per_sequence(bases, seq),
        q_count=per_sequence(counts, seq),
        q_reach=torch.where(seq >= 0, torch.div(pos + 1, ratio, rounding_mode="floor"), 0 * pos),
    )
