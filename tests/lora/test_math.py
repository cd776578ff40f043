"""LoRA math: block-diagonal `wo_a`, packed experts, zero-init exactness, merged weights."""

from __future__ import annotations

import pytest
import torch

from dsv4flash.lora import (LoraConfig, apply_lora, block_diagonal, grouped_from_shared_a, grouped_lora_delta,
                            grouped_lora_forward, lora_delta, lora_parameters, lora_state_dict, packed_expert_delta)
from dsv4flash.lora.layers import ExpertLoraLinear
from dsv4flash.lora.state import base_state_dict, merged_state_dict

from .conftest import randomize_adapters


def _dense_block_diagonal(weight, lora_a, lora_b, scaling, groups):
    """Reference: the dense [G·out_g, G·in_g] matrix over the concatenated input, built block by block."""
    out_g, in_g = weight.shape[0] // groups, weight.shape[1]
    dense = torch.zeros(groups * out_g, groups * in_g)
    for g in range(groups):
        a_g = lora_a[g] if lora_a.dim() == 3 else lora_a
        b_g = lora_b[g] if lora_b.dim() == 3 else lora_b[g * out_g:(g + 1) * out_g]
        block = weight[g * out_g:(g + 1) * out_g] + scaling * b_g @ a_g
        dense[g * out_g:(g + 1) * out_g, g * in_g:(g + 1) * in_g] = block
    return dense


@pytest.mark.parametrize("mode", ["per_group", "shared_a"])
def test_wo_a_lora_equals_the_dense_block_diagonal_delta(make_model, mode):
    model = make_model()
    apply_lora(model, LoraConfig(preset="full_linear", wo_a_lora=mode))
    randomize_adapters(model)
    wo_a = model.layers[7].attn.wo_a
    groups, in_g = wo_a.groups, wo_a.in_per_group
    o = torch.randn(2, 5, groups, in_g, generator=torch.Generator().manual_seed(3))  # [B,S,G,in_g]
    out = wo_a(o)  # [B,S,G·out_g]
    dense = _dense_block_diagonal(wo_a.weight.detach(), wo_a.lora_A.detach(), wo_a.lora_B.detach(), wo_a.scaling, groups)
    torch.testing.assert_close(out, o.flatten(-2) @ dense.T, rtol=1e-5, atol=1e-6)
    # The pure functions give the same delta, in wo_a's stored (group-major) layout.
    delta = grouped_lora_delta(wo_a.lora_A.detach(), wo_a.lora_B.detach(), wo_a.scaling, groups)
    torch.testing.assert_close(block_diagonal(wo_a.weight.detach() + delta, groups), dense)
    torch.testing.assert_close(grouped_lora_forward(o, wo_a.lora_A.detach(), wo_a.lora_B.detach(), wo_a.scaling),
                               o.flatten(-2) @ block_diagonal(delta, groups).T, rtol=1e-5, atol=1e-6)
    # No cross-group terms: perturbing group 1's input leaves group 0's output bit-identical.
    o2 = o.clone()
    o2[..., 1, :] += 1.0
    out_g = wo_a.rank
    assert torch.equal(wo_a(o2)[..., :out_g], out[..., :out_g])
    assert not torch.equal(wo_a(o2)[..., out_g:], out[..., out_g:])


def test_a_plain_lora_over_the_concatenated_input_would_mix_groups():
    """Negative control: B·A over [G·in_g] has non-zero off-diagonal blocks; block_diagonal() has none."""
    gen = torch.Generator().manual_seed(0)
    groups, in_g, out_g, r = 2, 64, 16, 4
    plain = torch.randn(groups * out_g, r, generator=gen) @ torch.randn(r, groups * in_g, generator=gen)
    assert plain[:out_g, in_g:].abs().max() > 0
    ours = block_diagonal(grouped_lora_delta(torch.randn(groups, r, in_g, generator=gen),
                                             torch.randn(groups, out_g, r, generator=gen), 2.0), groups)
    assert torch.count_nonzero(ours[:out_g, in_g:]) == 0 and torch.count_nonzero(ours[out_g:, :in_g]) == 0


def test_shared_a_converts_to_per_group_exactly():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 64, generator=gen), torch.randn(2 * 16, 4, generator=gen)
    a_g, b_g = grouped_from_shared_a(a, b, groups=2)
    assert a_g.shape == (2, 4, 64) and b_g.shape == (2, 16, 4)
    assert torch.equal(grouped_lora_delta(a_g, b_g, 2.0), grouped_lora_delta(a, b, 2.0, groups=2))


def test_packed_experts_equal_per_expert_math(make_model, tiny_cfg):
    model = make_model()
    apply_lora(model, "full_linear")
    randomize_adapters(model)
    moe = model.layers[3].ffn
    packed = moe.experts_lora.w2
    e = 5
    wrapper = moe.experts[e].w2
    assert isinstance(wrapper, ExpertLoraLinear)
    # Each expert reads a view of the one packed parameter.
    assert wrapper.lora_A.data_ptr() == packed.lora_A[e].data_ptr()
    x = torch.randn(7, wrapper.in_features, generator=torch.Generator().manual_seed(4))
    expected = x @ wrapper.weight.T + wrapper.scaling * (x @ packed.lora_A[e].T) @ packed.lora_B[e].T
    torch.testing.assert_close(wrapper(x), expected, rtol=1e-5, atol=1e-6)
    stacked = torch.stack([lora_delta(packed.lora_A[i], packed.lora_B[i], 2.0) for i in range(8)])
    torch.testing.assert_close(packed_expert_delta(packed.lora_A, packed.lora_B, 2.0), stacked)

    # The whole MoE equals a base MoE whose expert weights carry W_e + ΔW_e.
    h = torch.randn(2, 9, tiny_cfg.text.hidden_size, generator=torch.Generator().manual_seed(5))
    base = make_model().layers[3].ffn
    with torch.no_grad():
        for i, expert in enumerate(list(base.experts) + [base.shared_experts]):
            lora_expert = (list(moe.experts) + [moe.shared_experts])[i]
            for w in ("w1", "w2", "w3"):
                getattr(expert, w).weight += getattr(lora_expert, w).delta_weight()
    torch.testing.assert_close(moe(h), base(h), rtol=1e-5, atol=1e-6)

    # Gradients land in the packed tensors, only on the experts that received tokens.
    moe(h).square().sum().backward()
    _, idx = moe.gate(h.reshape(-1, h.shape[-1]))
    used = set(torch.unique(idx).tolist())
    for i in range(8):
        assert (packed.lora_A.grad[i].abs().sum() > 0) == (i in used)


def test_expert_keys_are_the_lifecycle_packed_layout(make_model, tiny_cfg):
    model = make_model()
    apply_lora(model, "full_linear")
    sd = lora_state_dict(model)
    e, r = tiny_cfg.text.n_routed_experts, 16
    assert sd["layers.4.ffn.experts.w1.lora_A.weight"].shape == (e, r, tiny_cfg.text.hidden_size)
    assert sd["layers.4.ffn.experts.w1.lora_B.weight"].shape == (e, tiny_cfg.text.moe_intermediate_size, r)
    assert not any(".experts.0." in k or "experts_lora" in k for k in sd)
    from dsv4flash.lifecycle.packed import PackedMoELoRA  # our own module: import it, never skip

    adapter = PackedMoELoRA.from_packed_tensors(sd, alpha=32.0)
    assert adapter.num_experts == e and adapter.rank == r
    per_expert = adapter.to_per_expert()
    assert torch.equal(per_expert["layers.4.ffn.experts.3.w2.lora_B.weight"], sd["layers.4.ffn.experts.w2.lora_B.weight"][3])


@pytest.mark.parametrize("preset", ["full_linear", "decoder_half", "vit_lr_0p1"])
def test_zero_init_b_leaves_the_output_bit_identical(make_model, vl_batch, preset):
    ids, types, images = vl_batch
    base = make_model()
    with torch.no_grad():
        expected = base(ids, types, images)
    model = make_model()
    apply_lora(model, preset)
    for key, p in lora_parameters(model).items():
        assert (torch.count_nonzero(p) == 0) == key.endswith("lora_B.weight")  # A random, B zero
    with torch.no_grad():
        assert torch.equal(model(ids, types, images), expected)


def test_zero_init_is_exact_in_bf16_and_with_the_router_opted_in(make_model, ids):
    base = make_model(torch.bfloat16)
    with torch.no_grad():
        expected = base(ids)
    model = make_model(torch.bfloat16)
    apply_lora(model, LoraConfig(preset="full_linear", include=["layers.**", "re:layers\\.\\d+\\.ffn\\.gate"]))
    assert "layers.0.ffn.gate" in apply_lora(model, model._dsv4flash_lora.config).modules
    with torch.no_grad():
        assert torch.equal(model(ids), expected)


def test_merged_weights_reproduce_the_adapted_model(make_model, vl_batch):
    ids, types, images = vl_batch
    model = make_model()
    apply_lora(model, LoraConfig(preset="vit_lr_0p1", include=["layers.**", "re:layers\\.\\d+\\.ffn\\.gate"]))
    randomize_adapters(model, std=0.02)
    merged = make_model()
    merged.load_state_dict(merged_state_dict(model))
    base_keys = set(make_model().state_dict())
    assert set(base_state_dict(model)) == base_keys
    with torch.no_grad():
        adapted, folded, plain = model(ids, types, images), merged(ids, types, images), make_model()(ids, types, images)
    torch.testing.assert_close(folded, adapted, rtol=1e-4, atol=1e-4)
    assert (adapted - plain).abs().max() > 1e-2  # the adapters do change the output


def test_shared_outer_experts_share_the_outer_factor(make_model, tiny_cfg):
    """w1/w3 share A across experts, w2 shares B; each expert still computes W_e + B_e·A_e."""
    text, r = tiny_cfg.text, 16
    model = make_model()
    handle = apply_lora(model, LoraConfig(preset="full_linear", expert_lora="shared_outer"))
    randomize_adapters(model)
    units = {a.name: a for a in handle.adapters}
    assert (units["layers.2.ffn.experts.w1"].shape_a, units["layers.2.ffn.experts.w1"].shape_b) == (
        (r, text.hidden_size), (text.n_routed_experts, text.moe_intermediate_size, r))
    assert (units["layers.2.ffn.experts.w2"].shape_a, units["layers.2.ffn.experts.w2"].shape_b) == (
        (text.n_routed_experts, r, text.moe_intermediate_size), (text.hidden_size, r))
    moe = model.layers[2].ffn
    w1, w2 = moe.experts_lora.w1, moe.experts_lora.w2
    assert moe.experts[3].w1.lora_A.data_ptr() == moe.experts[5].w1.lora_A.data_ptr() == w1.lora_A.data_ptr()
    deltas = packed_expert_delta(w2.lora_A, w2.lora_B, 2.0)
    for e in (0, 7):
        torch.testing.assert_close(moe.experts[e].w2.delta_weight(), deltas[e])
        torch.testing.assert_close(moe.experts[e].w1.delta_weight(), 2.0 * w1.lora_B[e] @ w1.lora_A)
    h = torch.randn(1, 9, text.hidden_size, generator=torch.Generator().manual_seed(6))
    moe(h).sum().backward()
    assert w1.lora_A.grad.abs().sum() > 0 and w2.lora_B.grad.abs().sum() > 0
