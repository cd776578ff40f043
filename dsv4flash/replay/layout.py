"""Where a sample's images sit in the compact (one placeholder per image) and the expanded sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4flash.model.image import IMAGE_END, IMAGE_START, TEXT, num_image_tokens


@dataclass(frozen=True)
class ImageSpanLayout:
    """One sample: `compact_len` rows, image placeholders at `placeholder_rows`, each expanding to a span.

    Text rows keep their order; compact row `c` lands on expanded row `c + Σ (span_i − 1)` over the images
    before it. Image spans are contiguous runs of `span_lengths[i]` expanded rows.
    """

    compact_len: int
    placeholder_rows: tuple[int, ...]
    span_lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.placeholder_rows) != len(self.span_lengths):
            raise ValueError(f"ImageSpanLayout: {len(self.placeholder_rows)} placeholders but "
                             f"{len(self.span_lengths)} span lengths")
        rows = list(self.placeholder_rows)
        if rows != sorted(set(rows)) or any(not 0 <= r < self.compact_len for r in rows):
            raise ValueError(f"ImageSpanLayout: placeholder rows {rows} must be distinct, ascending and inside "
                             f"0..{self.compact_len - 1}")
        if any(n < 1 for n in self.span_lengths):
            raise ValueError(f"ImageSpanLayout: span lengths must be >= 1, got {list(self.span_lengths)}")

    # ---- constructors -----------------------------------------------------------------------------
    @classmethod
    def from_compact_ids(cls, compact_ids: torch.Tensor, image_token_id: int,
                         span_lengths: Sequence[int]) -> "ImageSpanLayout":
        """Placeholders are the `image_token_id` rows of the compact prompt; one span length per image."""
        ids = torch.as_tensor(compact_ids).reshape(-1)
        rows = tuple((ids == image_token_id).nonzero().flatten().tolist())
        if len(rows) != len(span_lengths):
            raise ValueError(f"compact sequence has {len(rows)} image placeholders (image_token_id="
                             f"{image_token_id}) but {len(span_lengths)} image span lengths were given")
        return cls(int(ids.numel()), rows, tuple(int(n) for n in span_lengths))

    @classmethod
    def from_llm_grids(cls, compact_ids: torch.Tensor, image_token_id: int,
                       llm_grids: Sequence[Sequence[int]] | torch.Tensor) -> "ImageSpanLayout":
        """Span lengths from each image's aligner grid `(h, w)`: h·(w+1)+2 rows (vLLM's `llm_grid`)."""
        grids = torch.as_tensor(llm_grids).reshape(-1, 2).tolist() if len(llm_grids) else []
        return cls.from_compact_ids(compact_ids, image_token_id, [num_image_tokens(int(h), int(w)) for h, w in grids])

    @classmethod
    def from_token_types(cls, token_types: torch.Tensor) -> "ImageSpanLayout":
        """From the expanded sequence's token types (TEXT = -1, spans IMAGE_START … IMAGE_END, as the reference)."""
        types = torch.as_tensor(token_types).reshape(-1)
        starts = (types == IMAGE_START).nonzero().flatten().tolist()
        ends = (types == IMAGE_END).nonzero().flatten().tolist()
        if len(starts) != len(ends) or any(e < s for s, e in zip(starts, ends)):
            raise ValueError(f"token_types: {len(starts)} IMAGE_START and {len(ends)} IMAGE_END markers do not pair up")
        lengths = [e - s + 1 for s, e in zip(starts, ends)]
        inside = torch.zeros_like(types, dtype=torch.bool)
        for s, e in zip(starts, ends):
            inside[s:e + 1] = True
        if bool(((types != TEXT) & ~inside).any()) or bool(((types == TEXT) & inside).any()):
            raise ValueError("token_types: image-type rows outside IMAGE_START..IMAGE_END spans, or text inside one")
        rows, shift = [], 0
        for s, n in zip(starts, lengths):
            rows.append(s - shift)
            shift += n - 1
        return cls(int(types.numel()) - shift, tuple(rows), tuple(lengths))

    # ---- derived ----------------------------------------------------------------------------------
    @property
    def expanded_len(self) -> int:
        """Rows of the expanded sequence."""
        return self.compact_len + sum(n - 1 for n in self.span_lengths)

    def expanded_rows(self) -> torch.Tensor:
        """[compact_len] int64: the expanded row of each compact row (an image placeholder -> its span start)."""
        extra = torch.zeros(self.compact_len, dtype=torch.int64)
        for row, n in zip(self.placeholder_rows, self.span_lengths):
            if row + 1 < self.compact_len:
                extra[row + 1:] += n - 1
        return torch.arange(self.compact_len, dtype=torch.int64) + extra

    def image_rows(self) -> torch.Tensor:
        """[expanded_len] bool: True on every row of an image span (delimiters included)."""
        mask = torch.zeros(self.expanded_len, dtype=torch.bool)
        starts = self.expanded_rows()[list(self.placeholder_rows)].tolist() if self.placeholder_rows else []
        for start, n in zip(starts, self.span_lengths):
            mask[start:start + n] = True
        return mask

    def compact_text_rows(self) -> torch.Tensor:
        """[compact_len] bool: True on text rows of the compact sequence."""
        mask = torch.ones(self.compact_len, dtype=torch.bool)
        mask[list(self.placeholder_rows)] = False
        return mask
