"""Packed MoE LoRA: lossless per-expert <-> packed conversion, V4.1 fanout, clear format errors."""

from __future__ import annotations

import pytest
import torch

from dsv4flash.lifecycle.errors import AdapterFormatError
from dsv4flash.lifecycle.packed import PackedMoELoRA, packed_key, per_expert_key


def _random_bits(shape, dtype=torch.bfloat16, seed=0):
    """Arbitrary bit patterns (NaNs, infs, subnormals included): equality must be bitwise."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**16, shape, generator=gen, dtype=torch.int32).to(torch.int16).view(dtype)


def _bits_adapter(layers=(0, 3), e=5, hidden=8, inter=6, r=2):
    experts, seed = {}, 0
    io = {"w1": (hidden, inter), "w2": (inter, hidden), "w3": (hidden, inter)}
    for layer in layers:
        for proj, (d_in, d_out) in io.items():
            experts[(layer, proj)] = (_random_bits((e, r, d_in), seed=seed), _random_bits((e, d_out, r), seed=seed + 1))
            seed += 2
    dense = {"layers.0.attn.wq_a": (_random_bits((r, hidden), seed=90), _random_bits((4, r), seed=91)),
             "layers.0.attn.wo_a": (_random_bits((2, r, 8), seed=92), _random_bits((2, 3, r), seed=93))}
    return PackedMoELoRA(rank=r, alpha=2.0 * r, num_experts=e, experts=experts, dense=dense)


def test_round_trip_is_bit_exact():
    packed = _bits_adapter()
    per_expert = packed.to_per_expert()
    assert len(per_expert) == packed.tensors_per_expert_layout() == 2 * (2 * 3 * 5 + 2)
    back = PackedMoELoRA.from_per_expert(per_expert, alpha=packed.alpha)
    assert back.equal(packed)
    assert back.tensors_packed_layout() == len(back.to_packed_tensors()) == 2 * (2 * 3 + 2)
    again = PackedMoELoRA.from_packed_tensors(back.to_packed_tensors(), alpha=packed.alpha)
    assert again.equal(packed) and again.nbytes() == packed.nbytes()
    # per-expert tensors are views of the packed ones: expert e of layer 3 w2 is slice e
    a, b = packed.experts[(3, "w2")]
    assert torch.equal(per_expert[per_expert_key(3, 4, "w2", "A")].view(torch.int16), a[4].view(torch.int16))
    # a flipped bit is detected
    per_expert[per_expert_key(0, 1, "w1", "B")] = per_expert[per_expert_key(0, 1, "w1", "B")].clone()
    per_expert[per_expert_key(0, 1, "w1", "B")].view(torch.int16)[0, 0] ^= 1
    assert not PackedMoELoRA.from_per_expert(per_expert, alpha=packed.alpha).equal(packed)


def test_v41_tensor_fanout_without_allocating():
    """V4.1 flash: 40 MoE layers x 384 experts x 3 projections x A/B = 92 160 tensors -> 240 packed."""
    e, r = 384, 1
    meta = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16)  # noqa: E731
    experts = {}
    for layer in range(40):
        for proj, (d_in, d_out) in {"w1": (5120, 2304), "w2": (2304, 5120), "w3": (5120, 2304)}.items():
            experts[(layer, proj)] = (meta(e, r, d_in), meta(e, d_out, r))
    ad = PackedMoELoRA(rank=r, alpha=2.0, num_experts=e, experts=experts)
    assert ad.tensors_per_expert_layout() == 92_160 and ad.tensors_packed_layout() == 240
    assert ad.nbytes() == 342_097_920 * 2  # docs/lifecycle.md: 342.1 M params per rank, 684 MB BF16


def test_missing_expert_and_shape_errors():
    packed = _bits_adapter(layers=(1,), e=3)
    tensors = packed.to_per_expert()
    del tensors[per_expert_key(1, 2, "w3", "B")]
    with pytest.raises(AdapterFormatError, match=r"missing layers\.1\.ffn\.experts\.2\.w3\.lora_B\.weight.*all 3 are required"):
        PackedMoELoRA.from_per_expert(tensors, alpha=4.0, source="x.safetensors")
    tensors = packed.to_per_expert()
    tensors[per_expert_key(1, 0, "w1", "A")] = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(AdapterFormatError, match="disagree on shape"):
        PackedMoELoRA.from_per_expert(tensors, alpha=4.0)
    with pytest.raises(AdapterFormatError, match="not a LoRA factor"):
        PackedMoELoRA.from_per_expert({"layers.0.attn.wq_a.weight": torch.zeros(2, 2)}, alpha=1.0)
    with pytest.raises(AdapterFormatError, match="rank 3/3 differs"):
        PackedMoELoRA(rank=2, alpha=1.0, num_experts=2, experts={(0, "w1"): (torch.zeros(2, 3, 4), torch.zeros(2, 5, 3))})
    with pytest.raises(AdapterFormatError, match="per-expert key in a packed adapter"):
        PackedMoELoRA.from_packed_tensors(tensors, alpha=1.0)


def test_delta_matches_manual_math():
    ad = PackedMoELoRA.random(layers=[2], num_experts=3, hidden=8, moe_inter=6, rank=2, alpha=3.0,
                              dense_shapes={"layers.2.attn.wkv": (4, 8)}, dtype=torch.float32)
    a, b = ad.experts[(2, "w3")]
    torch.testing.assert_close(ad.delta("layers.2.ffn.experts.w3", expert=1), 1.5 * b[1] @ a[1])
    a, b = ad.dense["layers.2.attn.wkv"]
    torch.testing.assert_close(ad.delta("layers.2.attn.wkv"), 1.5 * b @ a)


def test_canonical_keys_of_dsv4flash_lora_are_a_packed_adapter(tiny_cfg):
    """`dsv4flash.lora.lora_state_dict(model)` loads as a packed adapter as-is (same canonical keys)."""
    from dsv4flash.lora import LoraConfig, apply_lora, lora_state_dict
    from dsv4flash.model.transformer import Transformer

    model = Transformer(tiny_cfg, seed=0)
    apply_lora(model, LoraConfig(preset="full_linear", rank=2))
    state = lora_state_dict(model)
    ad = PackedMoELoRA.from_packed_tensors(state, alpha=4.0)
    assert ad.num_experts == tiny_cfg.text.n_routed_experts
    assert ad.to_packed_tensors().keys() == state.keys()
    assert packed_key(0, "w1", "A") in state and state["layers.0.attn.wo_a.lora_A.weight"].dim() == 3
    assert PackedMoELoRA.from_per_expert(ad.to_per_expert(), alpha=4.0).equal(ad)
