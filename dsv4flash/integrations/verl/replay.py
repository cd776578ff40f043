"""Text-only R3 routing replay inside veRL's Megatron engine (the runtime side of DSV41-VERL-004).

veRL's R3 aligns rollout routes with the training inputs row for row (`align_r3_router_replay_data`) and
replays every causal row but the last (`build_r3_replay_mask`). For V4.1 image prompts vLLM records routes on
the compact prompt while Megatron trains on the expanded sequence, and image rows were routed with
`bias_vl`, so the routes must be moved to their expanded rows and image rows must route natively. The batch
carries that per sample (`dsv4flash.replay.r3_batch_keys`):

* `r3_row_map` — nested int64 [R_i]: the training row of each recorded route row, −1 = never replayed;
* `r3_native_rows` — nested bool [S_i]: rows that always route natively (image spans).

`prepare_model_inputs` stashes them for the micro-batch being built; the two veRL functions then consult them
when they are called on that micro-batch's `input_ids` (the same tensor `forward_step` passes on), so a stash
never outlives its micro-batch.
Batches without the keys take veRL's own behaviour unchanged. The Megatron router that replays them is
`dsv4flash.integrations.mcore.router.ModalityTopKRouter` (sqrtsoftplus, per-token `bias`/`bias_vl`), which
veRL's replay patch leaves in place because it overrides `routing` (docs/upstream.md §4.2).
"""

from __future__ import annotations

import contextvars
import weakref

import torch

ROW_MAP, NATIVE_ROWS = "r3_row_map", "r3_native_rows"
_current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("dsv4flash_r3_keys", default=None)


def stash_micro_batch(batch) -> None:
    """Remember the text-only replay keys of the micro-batch `prepare_model_inputs` is building (None if absent)."""
    keys = {k: _get(batch, k) for k in (ROW_MAP, NATIVE_ROWS)}
    input_ids = _get(batch, "input_ids")
    if keys[ROW_MAP] is None or input_ids is None:
        _current.set(None)
        return
    # Held weakly and matched by identity: only calls on this micro-batch's own ids see its keys.
    _current.set({**keys, "input_ids": weakref.ref(input_ids)})


def _get(batch, key):
    try:
        return batch.get(key, None)
    except (KeyError, AttributeError):
        return None


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.unbind()) if getattr(t, "is_nested", False) else [t]


def _keys(input_ids: torch.Tensor, row_map=None, native_rows=None) -> dict | None:
    """Explicit keys (the upstream form's keywords) win over the stash of the micro-batch `input_ids` belong to."""
    if row_map is not None:
        return {ROW_MAP: row_map, NATIVE_ROWS: native_rows}
    stash = _current.get()
    if stash is None or stash["input_ids"]() is not input_ids:
        return None
    return stash


def align_routes(layers_topk_idx: torch.Tensor, input_ids: torch.Tensor, original, row_map=None):
    """`align_r3_router_replay_data` that moves each recorded row to its training row (text-only replay)."""
    keys = _keys(input_ids, row_map)
    if keys is None:
        return original(layers_topk_idx, input_ids)
    if not layers_topk_idx.is_nested or not input_ids.is_nested:
        raise TypeError("text-only R3 replay requires jagged route targets and input_ids")
    routes, maps = _parts(layers_topk_idx), _parts(keys[ROW_MAP])
    lengths = [int(n) for n in input_ids.offsets().diff().tolist()]
    if not len(routes) == len(maps) == len(lengths):
        raise RuntimeError(f"text-only R3: {len(routes)} route sequences, {len(maps)} r3_row_map entries, "
                           f"{len(lengths)} input sequences")
    out = []
    for i, (r, m, n) in enumerate(zip(routes, maps, lengths)):
        m = m.to(device=r.device, dtype=torch.long)
        if m.numel() != r.shape[0]:
            raise RuntimeError(f"text-only R3 sample {i}: {r.shape[0]} recorded route rows but r3_row_map has "
                               f"{m.numel()} entries")
        keep = m >= 0
        if keep.any() and int(m[keep].max()) >= n:
            raise RuntimeError(f"text-only R3 sample {i}: r3_row_map points at row {int(m[keep].max())} of a "
                               f"{n}-row training sequence")
        aligned = torch.zeros((n, *r.shape[1:]), dtype=r.dtype, device=r.device)
        aligned[m[keep]] = r[keep]
        out.append(aligned)
    return torch.nested.as_nested_tensor(out, layout=torch.jagged)


def replay_mask(input_ids: torch.Tensor, response_mask: torch.Tensor, original, row_map=None, native_rows=None):
    """`build_r3_replay_mask` restricted to rows with a recorded route that are not native (image) rows."""
    mask = original(input_ids, response_mask)
    keys = _keys(input_ids, row_map, native_rows)
    if keys is None:
        return mask
    masks, maps = _parts(mask), _parts(keys[ROW_MAP])
    natives = _parts(keys[NATIVE_ROWS]) if keys[NATIVE_ROWS] is not None else [None] * len(masks)
    parts = []
    for i, (m, rows, native) in enumerate(zip(masks, maps, natives, strict=True)):
        recorded = torch.zeros_like(m, dtype=torch.bool)
        rows = rows.to(device=m.device, dtype=torch.long)
        recorded[rows[rows >= 0]] = True
        keep = m.bool() & recorded
        if native is not None:
            native = native.to(device=m.device, dtype=torch.bool)
            if native.shape != m.shape:
                raise RuntimeError(f"text-only R3 sample {i}: r3_native_rows has {native.numel()} rows, the "
                                   f"training sequence {m.numel()}")
            keep = keep & ~native
        parts.append(keep)
    return torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets=input_ids.offsets())
