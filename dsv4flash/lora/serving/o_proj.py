"""The grouped output projection `wo_a` of V4.1 attention, base and LoRA, in vLLM's token-major layout.

vLLM computes `z = wo_a(inverse_rope(attn_out))` group by group: the attention output `[T, H, hd]` is
split into G groups of `H/G` heads, group g is projected by its own block `W_g [out_g, in_g]` of the
group-major weight `[G·out_g, in_g]`, and `wo_b` consumes `z [T, G·out_g]`. A LoRA on `wo_a` must be
block-diagonal in the same way (`dsv4flash.lora.GroupedLoraProjection`); these functions give the base
(BF16, or an emulation of the FP8 `fp8_einsum` kernel) and the per-token multi-adapter delta.
"""

from __future__ import annotations

import torch

from dsv4flash.lora.serving.multi_adapter import SlotStacks, slot_grouped_lora_delta
from dsv4flash.lora.serving.rope import inverse_rope_heads
from dsv4flash.model.quant import E4M3_MAX, pow2_scale


def split_groups(o: torch.Tensor, n_groups: int) -> torch.Tensor:
    """[T, H, hd] -> [T, G, (H/G)·hd]: the per-group input of `wo_a` (heads of a group are contiguous)."""
    tokens, heads, head_dim = o.shape
    if heads % n_groups:
        raise ValueError(f"split_groups: {heads} heads do not split into {n_groups} groups")
    return o.reshape(tokens, n_groups, heads // n_groups * head_dim)


def grouped_o_proj_base(o_rot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """BF16/FP32 base: o_rot [T, G, in_g] · W [G·out_g, in_g] block-wise -> z [T, G·out_g] in o_rot's dtype."""
    tokens, groups, in_g = o_rot.shape
    if weight.shape[1] != in_g or weight.shape[0] % groups:
        raise ValueError(f"grouped_o_proj_base: weight {list(weight.shape)} does not fit {groups} groups of "
                         f"{in_g} inputs")
    w = weight.view(groups, weight.shape[0] // groups, in_g).to(o_rot.dtype)  # [G, out_g, in_g]
    return torch.einsum("tgd,god->tgo", o_rot, w).reshape(tokens, -1)


def _quantize_activation_e4m3(x: torch.Tensor, block: int) -> torch.Tensor:
    """Dynamic FP8 E4M3 activation quantisation over `block`-lane groups with power-of-two scales, dequantised."""
    if x.shape[-1] % block:
        raise ValueError(f"activation width {x.shape[-1]} is not a multiple of the FP8 block {block}")
    xb = x.float().unflatten(-1, (-1, block))
    scale = pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=1e-12), E4M3_MAX)
    q = (xb / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2)


def grouped_o_proj_fp8_base(o_rot: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                            act_block: int = 128, name: str = "wo_a") -> torch.Tensor:
    """Emulation of vLLM's FP8 `wo_a` (`fp8_einsum`): FP8 activations × stored FP8 weight -> z [T, G·out_g] fp32.

    `codes`/`scale` are the release layout (E4M3 `[G·out_g, in_g]`, E8M0 32×32 block scales), decoded with the
    checkpoint bridge's codec; activations are quantised per `act_block` lanes as the kernel does.
    """
    from dsv4flash_bridge.codecs import decode_dense_fp8

    weight = decode_dense_fp8(codes, scale, dtype=torch.float32, name=name)
    return grouped_o_proj_base(_quantize_activation_e4m3(o_rot, act_block), weight)


def o_proj_lora_delta(attn_out: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, n_heads: int,
                      n_groups: int, token_slots: torch.Tensor, stacks: SlotStacks) -> torch.Tensor:
    """LoRA delta of `wo_a` for a vLLM attention output: attn_out [T, H_pad, hd] -> [T, G·out_g] fp32.

    Only the first `n_heads` heads are real (backends pad H); the delta uses the un-rotated, unquantised
    activation, like a stock LoRA linear (`requires_unquantized_input`).
    """
    o = inverse_rope_heads(attn_out[:, :n_heads, :], positions, cache)  # [T, H, hd]
    return slot_grouped_lora_delta(split_groups(o, n_groups), token_slots, stacks)
