"""The CSA2 compressor's input projection with LoRA, fp32 output as vLLM and the reference compute it.

vLLM fuses the compressor's `wkv` and `wgate` into one `[n·head_dim, D]` weight (`fused_wkv_wgate`; n = 2
for ratio 2, n = 1 for the ratio-1 CED source which has no gate) and computes `kv_score = x·Wᵀ` with an
fp32 output. A LoRA on either projection adds its delta to its own column slice of `kv_score`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4flash.lora.serving.multi_adapter import SlotStacks, slot_lora_delta


def compressor_lora_delta(x: torch.Tensor, token_slots: torch.Tensor, slices: Sequence[SlotStacks | None],
                          output_slices: Sequence[int]) -> torch.Tensor:
    """Per-slice multi-adapter delta: x [T, D] -> [T, Σ output_slices] fp32 (a `None` slice has no LoRA)."""
    if len(slices) != len(output_slices):
        raise ValueError(f"compressor_lora_delta: {len(slices)} LoRA slices for {len(output_slices)} output slices")
    parts = []
    for stacks, width in zip(slices, output_slices):
        if stacks is None:
            parts.append(torch.zeros(x.shape[0], width, dtype=torch.float32, device=x.device))
            continue
        if stacks.b.shape[1] != width:
            raise ValueError(f"compressor_lora_delta: a slice of width {width} got B rows {stacks.b.shape[1]}")
        parts.append(slot_lora_delta(x, token_slots, stacks))
    return torch.cat(parts, dim=-1)


def compressor_kv_score(x: torch.Tensor, weight: torch.Tensor, token_slots: torch.Tensor | None = None,
                        slices: Sequence[SlotStacks | None] = (), output_slices: Sequence[int] = ()) -> torch.Tensor:
    """kv_score = x·Wᵀ (fp32 accumulate and output) + the LoRA delta: x [T, D], W [n·hd, D] -> [T, n·hd] fp32."""
    score = x.float() @ weight.float().t()
    if token_slots is None or not slices:
        return score
    return score + compressor_lora_delta(x, token_slots, slices, output_slices)
