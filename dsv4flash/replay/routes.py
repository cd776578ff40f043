"""Recorded routes (compact or expanded rows) -> expanded routes plus a text-only replay mask.

Recorded routes are `[R, L, k]` (rows × MoE layers × top-k expert ids). A rollout may have one row fewer than
the sequence (no route is recorded for the final generated token). Rows that are not replayed route natively.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4flash.replay.layout import ImageSpanLayout


def row_map(layout: ImageSpanLayout, route_rows: int) -> torch.Tensor:
    """[route_rows] int64: the expanded row each recorded route row replays onto, −1 for rows never replayed.

    Compact recordings (`compact_len` or one fewer rows) move text rows to their expanded position and drop
    the image placeholders; expanded recordings (`expanded_len` or one fewer) keep text rows in place and drop
    the image-span rows. Image rows always route natively (they were chosen with `bias_vl` in the rollout).
    """
    has_images = bool(layout.placeholder_rows)
    if route_rows in (layout.compact_len, layout.compact_len - 1):
        out = layout.expanded_rows()[:route_rows].clone()
        out[~layout.compact_text_rows()[:route_rows]] = -1
        return out
    if has_images and route_rows in (layout.expanded_len, layout.expanded_len - 1):
        out = torch.arange(route_rows, dtype=torch.int64)
        out[layout.image_rows()[:route_rows]] = -1
        return out
    raise ValueError(f"recorded routes have {route_rows} rows; expected the compact length {layout.compact_len} "
                     f"or the expanded length {layout.expanded_len} (or one fewer: no route for the final token)")


def expand_routes(routes: torch.Tensor, layout: ImageSpanLayout, fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """routes [R, L, k] -> (expanded routes [S_e, L, k], replayed [S_e] bool); unreplayed rows hold `fill`."""
    if routes.dim() != 3:
        raise ValueError(f"expand_routes: routes must be [rows, layers, topk], got {list(routes.shape)}")
    mapping = row_map(layout, routes.shape[0])
    keep = mapping >= 0
    out = torch.full((layout.expanded_len, *routes.shape[1:]), fill, dtype=routes.dtype, device=routes.device)
    out[mapping[keep].to(routes.device)] = routes[keep.to(routes.device)]
    replayed = torch.zeros(layout.expanded_len, dtype=torch.bool)
    replayed[mapping[keep]] = True
    return out, replayed.to(routes.device)


def text_replay_mask(layout: ImageSpanLayout, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[S_e] bool: `mask` (default all True) with every image-span row switched to native routing."""
    text = ~layout.image_rows()
    if mask is None:
        return text
    if mask.shape != text.shape:
        raise ValueError(f"text_replay_mask: mask has shape {list(mask.shape)}, the expanded sequence {layout.expanded_len}")
    return mask.bool() & text.to(mask.device)


def r3_replay_mask(layout: ImageSpanLayout, response_len: int, route_rows: int) -> torch.Tensor:
    """veRL's R3 rule on the expanded sequence, restricted to text rows that have a recorded route.

    R3 replays every causal row that can influence the response log-probs and leaves the final row native
    (its logits are unused); with no response nothing is replayed. Image rows and rows without a recorded
    route always route natively.
    """
    causal = torch.zeros(layout.expanded_len, dtype=torch.bool)
    if response_len > 0:
        causal[: layout.expanded_len - 1] = True
    recorded = torch.zeros(layout.expanded_len, dtype=torch.bool)
    mapping = row_map(layout, route_rows)
    recorded[mapping[mapping >= 0]] = True
    return text_replay_mask(layout, causal & recorded)


def r3_batch_keys(layouts: Sequence[ImageSpanLayout], route_rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """The per-sample batch keys veRL's text-only R3 reads, as jagged nested tensors.

    `r3_row_map` [R_i] int64 (see `row_map`) and `r3_native_rows` [S_e,i] bool (True = route natively).
    """
    if len(layouts) != len(route_rows):
        raise ValueError(f"r3_batch_keys: {len(layouts)} layouts for {len(route_rows)} route tensors")
    maps = [row_map(lay, n) for lay, n in zip(layouts, route_rows)]
    native = [lay.image_rows() for lay in layouts]
    return {
        "r3_row_map": torch.nested.as_nested_tensor(maps, layout=torch.jagged),
        "r3_native_rows": torch.nested.as_nested_tensor(native, layout=torch.jagged),
    }
