"""Pure LoRA math shared by the reference wrappers and the engine integrations (no modules, no state).

Conventions (PEFT's): A is [r, in], B is [out, r], ΔW = scaling · B·A with scaling = alpha / r. The
grouped output projection `wo_a` is block-diagonal: group g has its own A_g [r, in_g] and B_g [out_g, r],
stored stacked as A [G, r, in_g] and B [G, out_g, r] (or, shared-A, one A [r, in_g] and B [G·out_g, r]);
routed experts are stacked like the per-group form over E.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """ΔW = scaling · B·A: A [r, in], B [out, r] -> [out, in] (fp32)."""
    return scaling * (lora_b.float() @ lora_a.float())


def lora_forward(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                 dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """scaling · B(A(dropout(x))): x [..., in] -> [..., out] in A's dtype (low-rank, never forms ΔW)."""
    x = F.dropout(x.to(lora_a.dtype), dropout, training) if dropout else x.to(lora_a.dtype)
    return F.linear(F.linear(x, lora_a), lora_b) * scaling


def per_group_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Either grouped parameterisation -> per-group views A [G, r, in_g], B [G, out_g, r] (no copies).

    Per-group: A [G, r, in_g], B [G, out_g, r] (passed through). Shared-A (miles PR #2771 / NeMo):
    A [r, in_g] used by every group, B [G·out_g, r] whose group-major row blocks are the B_g.
    """
    if lora_a.dim() == 3:
        return lora_a, lora_b
    return lora_a.unsqueeze(0).expand(groups, *lora_a.shape), lora_b.view(groups, -1, lora_b.shape[-1])


def grouped_lora_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                       groups: int | None = None) -> torch.Tensor:
    """Block-diagonal ΔW of `wo_a` in its stored layout [G·out_g, in_g] (fp32).

    Rows g·out_g … (g+1)·out_g − 1 hold ΔW_g = scaling · B_g·A_g, the same group-major layout as
    `wo_a.weight`, so `wo_a.weight + grouped_lora_delta(...)` is the merged weight. `groups` is only
    needed for the shared-A parameterisation (2-D factors).
    """
    a, b = per_group_factors(lora_a, lora_b, groups or 1)
    return (scaling * torch.bmm(b.float(), a.float())).flatten(0, 1)


def grouped_lora_forward(o: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                         dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """Per-group low-rank update: o [..., G, in_g] -> [..., G·out_g]; group g only sees its own input o_g."""
    a, b = per_group_factors(lora_a, lora_b, o.shape[-2])
    o = o.to(a.dtype)
    if dropout:
        o = F.dropout(o, dropout, training)
    t = torch.einsum("...gd,grd->...gr", o, a)  # [..., G, r]
    return (torch.einsum("...gr,gor->...go", t, b) * scaling).flatten(-2)  # [..., G·out_g]


def block_diagonal(delta: torch.Tensor, groups: int) -> torch.Tensor:
    """Stored-layout grouped weight [G·out_g, in_g] -> the equivalent dense [G·out_g, G·in_g] over the
    concatenated input (zero off-diagonal blocks): what a plain linear would need to reproduce it."""
    out_g = delta.shape[0] // groups
    return torch.block_diag(*delta.view(groups, out_g, -1).unbind(0))


def grouped_from_shared_a(lora_a: torch.Tensor, lora_b: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-A parameterisation (A [r, in_g], B [G·out_g, r]; miles/NeMo) -> our per-group (A [G,r,in_g],
    B [G,out_g,r]); the represented ΔW is identical."""
    return lora_a.unsqueeze(0).expand(groups, *lora_a.shape).clone(), lora_b.view(groups, -1, lora_b.shape[-1]).clone()


def packed_expert_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """Per-expert ΔW_e = scaling · B_e·A_e: A [E, r, in] or shared [r, in], B [E, out, r] or shared
    [out, r] -> [E, out, in] (fp32)."""
    return scaling * torch.matmul(lora_b.float(), lora_a.float())
