"""Per-token multi-adapter LoRA with punica slot semantics, for plain and block-diagonal (grouped) weights.

A batch mixes requests of different adapters. Like vLLM's punica kernels, each token carries a *slot*
index into stacked adapter factors (`-1` = no adapter) and the factors of all loaded adapters sit in
stacks: `A [S, r, in]`, `B [S, out, r]` with the adapter scaling already folded into `B` (vLLM's
`LoRALayerWeights.optimize`) and ranks below the stack rank zero-padded. The functions below are
CUDA-graph safe: no host synchronisation, every slot is evaluated densely and masked, which costs
`S` times one adapter's FLOPs (`S` = `max_loras`, small in RL serving).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4flash.lora.functional import grouped_from_shared_a, grouped_lora_forward, lora_forward


@dataclass(frozen=True)
class SlotStacks:
    """Stacked factors of every slot: `a` [S, (G,) r, in], `b` [S, (G,) out, r] (scaling folded into b)."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def slots(self) -> int:
        """Number of adapter slots S."""
        return self.a.shape[0]


def _check_slots(token_slots: torch.Tensor, tokens: int, where: str) -> None:
    """Shape/dtype check only: reading slot values would force a host sync (and break CUDA graphs)."""
    if token_slots.dim() != 1 or token_slots.shape[0] != tokens:
        raise ValueError(f"{where}: token_slots must be [T={tokens}], got {list(token_slots.shape)}")
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: token_slots must be an integer tensor, got {token_slots.dtype}")


def slot_lora_delta(x: torch.Tensor, token_slots: torch.Tensor, stacks: SlotStacks,
                    compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """delta[t] = B[s_t]·A[s_t]·x[t], zero where s_t < 0: x [T, in], slots [T] -> [T, out] fp32."""
    a, b = stacks.a, stacks.b
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
        raise ValueError(f"slot_lora_delta: expected A [S, r, in] and B [S, out, r], got {list(a.shape)} / "
                         f"{list(b.shape)}")
    if x.shape[-1] != a.shape[-1]:
        raise ValueError(f"slot_lora_delta: x has {x.shape[-1]} input features, A expects {a.shape[-1]}")
    _check_slots(token_slots, x.shape[0], "slot_lora_delta")
    xc = x.to(compute_dtype)
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(a.shape[0]):
        chosen = (token_slots == slot).unsqueeze(-1)  # [T, 1]
        delta = lora_forward(xc, a[slot].to(compute_dtype), b[slot].to(compute_dtype), 1.0).float()  # [T, out]
        out = out + torch.where(chosen, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
    return out


def slot_grouped_lora_delta(o: torch.Tensor, token_slots: torch.Tensor, stacks: SlotStacks,
                            compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-diagonal per-token delta: o [T, G, in_g], A [S, G, r, in_g], B [S, G, out_g, r] -> [T, G·out_g] fp32.

    Group g of token t sees only its own input o[t, g] (no cross-group terms), with adapter slot s_t.
    """
    a, b = stacks.a, stacks.b
    if a.dim() != 4 or b.dim() != 4 or a.shape[:2] != b.shape[:2] or a.shape[2] != b.shape[3]:
        raise ValueError(f"slot_grouped_lora_delta: expected A [S, G, r, in_g] and B [S, G, out_g, r], got "
                         f"{list(a.shape)} / {list(b.shape)}")
    if o.dim() != 3 or o.shape[1] != a.shape[1] or o.shape[2] != a.shape[3]:
        raise ValueError(f"slot_grouped_lora_delta: o must be [T, G={a.shape[1]}, in_g={a.shape[3]}], got "
                         f"{list(o.shape)}")
    _check_slots(token_slots, o.shape[0], "slot_grouped_lora_delta")
    oc = o.to(compute_dtype)
    out = torch.zeros(o.shape[0], b.shape[1] * b.shape[2], dtype=torch.float32, device=o.device)
    for slot in range(a.shape[0]):
        chosen = (token_slots == slot).unsqueeze(-1)  # [T, 1]
        delta = grouped_lora_forward(oc, a[slot].to(compute_dtype), b[slot].to(compute_dtype), 1.0).float()
        out = out + torch.where(chosen, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
    return out


def grouped_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, groups: int, out_per_group: int,
                    name: str = "wo_a") -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise a `wo_a` adapter to per-group factors A [G, r, in_g], B [G, out_g, r].

    Accepts our per-group layout (3-D, `dsv4flash.lora`) and the shared-A layout of miles/NeMo (A [r, in_g],
    B [G·out_g, r]: every group projects through the same A). Anything else is an error naming `name`.
    """
    if lora_a.dim() == 3 and lora_b.dim() == 3:
        if lora_a.shape[0] != groups or lora_b.shape[0] != groups or lora_b.shape[1] != out_per_group:
            raise ValueError(f"{name}: per-group LoRA must be A [G={groups}, r, in_g] and B [G, out_g="
                             f"{out_per_group}, r], got {list(lora_a.shape)} / {list(lora_b.shape)}")
        return lora_a, lora_b
    if lora_a.dim() == 2 and lora_b.dim() == 2:
        if lora_b.shape[0] != groups * out_per_group:
            raise ValueError(f"{name}: shared-A LoRA must have B [G·out_g={groups * out_per_group}, r], got "
                             f"{list(lora_b.shape)}")
        return grouped_from_shared_a(lora_a, lora_b, groups)
    raise ValueError(f"{name}: grouped LoRA factors must be per-group 3-D (A [G, r, in_g], B [G, out_g, r]) or "
                     f"shared-A 2-D (A [r, in_g], B [G·out_g, r]); got {list(lora_a.shape)} / {list(lora_b.shape)}")


def slice_groups(lora_a: torch.Tensor, lora_b: torch.Tensor, tp_rank: int, tp_size: int,
                 name: str = "wo_a") -> tuple[torch.Tensor, torch.Tensor]:
    """The groups a tensor-parallel rank owns (contiguous, as vLLM shards `wo_a`'s group-major rows)."""
    groups = lora_a.shape[0]
    if groups % tp_size:
        raise ValueError(f"{name}: {groups} groups do not split over tensor-parallel size {tp_size}")
    local = groups // tp_size
    rows = slice(tp_rank * local, (tp_rank + 1) * local)
    return lora_a[rows], lora_b[rows]
