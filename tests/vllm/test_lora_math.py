"""The pure-torch serving math (`dsv4flash.lora.serving`) against the reference model with LoRA applied."""

from __future__ import annotations

import pytest
import torch

from dsv4flash.lora import LoraConfig, apply_lora
from dsv4flash.lora.serving import (SlotStacks, compressor_kv_score, cos_sin_cache, grouped_factors,
                                 grouped_o_proj_base, grouped_o_proj_fp8_base, inverse_rope_heads, o_proj_lora_delta,
                                 slice_groups, slot_grouped_lora_delta, slot_lora_delta, split_groups)
from dsv4flash.model.rope import apply_rope, rope_frequencies

pytestmark = pytest.mark.parity

TARGETS = ["layers.*.attn.wo_a", "layers.*.attn.compressor.wkv", "layers.*.attn.compressor.wgate"]


def _randomise_b(model: torch.nn.Module, seed: int) -> None:
    """Fresh adapters have B = 0 (a no-op); give every factor a non-trivial value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _adapted_model(seed: int, wo_a_lora: str = "per_group"):
    from dsv4flash.model.transformer import Transformer

    model = Transformer("tiny", seed=0)
    apply_lora(model, LoraConfig(preset="custom", include=list(TARGETS), rank=4, alpha=8.0, seed=seed,
                                 wo_a_lora=wo_a_lora))
    _randomise_b(model, seed)
    return model.eval()


def _capture(module: torch.nn.Module, store: dict, key: str):
    def hook(_m, args, out):
        store[key] = (args[0].detach().clone(), out.detach().clone())
    return module.register_forward_hook(hook)


def _stacks_grouped(*wrappers) -> SlotStacks:
    """Per-slot stacks from reference GroupedLoraProjection wrappers, scaling folded into B (vLLM optimize)."""
    a, b = [], []
    for w in wrappers:
        pa, pb = grouped_factors(w.lora_A.detach(), w.lora_B.detach(), w.groups, w.rank)
        a.append(pa)
        b.append(pb * w.scaling)
    return SlotStacks(torch.stack(a), torch.stack(b))


def _stacks_linear(*wrappers) -> SlotStacks:
    return SlotStacks(torch.stack([w.lora_A.detach() for w in wrappers]),
                      torch.stack([w.lora_B.detach() * w.scaling for w in wrappers]))


@pytest.fixture(scope="module")
def forward_records():
    """One tiny forward per adapter, recording wo_a and compressor inputs/outputs of layers 2 (ratio 2) and 6 (ratio 1)."""
    ids = torch.randint(3, 400, (1, 24), generator=torch.Generator().manual_seed(1))
    out = {}
    for seed in (11, 12):
        model = _adapted_model(seed)
        rec: dict = {}
        hooks = []
        for layer in (2, 6):
            attn = model.layers[layer].attn
            hooks.append(_capture(attn.wo_a, rec, f"{layer}.wo_a"))
            hooks.append(_capture(attn.compressor.wkv, rec, f"{layer}.wkv"))
            if attn.compressor.wgate is not None:
                hooks.append(_capture(attn.compressor.wgate, rec, f"{layer}.wgate"))
        with torch.no_grad():
            model(ids)
        for h in hooks:
            h.remove()
        out[seed] = (model, rec)
    return out


@pytest.mark.parametrize("layer", [2, 6])
def test_o_proj_from_vllm_layout_equals_reference_wo_a(forward_records, layer):
    """vLLM's pre-inverse-RoPE attention output -> our inverse RoPE + base + delta == reference wo_a with LoRA."""
    model, rec = forward_records[11]
    attn = model.layers[layer].attn
    o_grouped, z_ref = rec[f"{layer}.wo_a"]  # [1,S,G,in_g] (already un-rotated), [1,S,G·out_g]
    seq = o_grouped.shape[1]
    heads, head_dim = attn.heads, attn.head_dim
    rot = attn.rotation(torch.arange(seq))
    attn_out = apply_rope(o_grouped.reshape(1, seq, heads, head_dim), rot)[0]  # what vLLM's attention writes
    # backends pad the head axis; padded heads must be ignored
    attn_out = torch.cat([attn_out, torch.full((seq, 2, head_dim), 7.0)], dim=1)
    freqs = rope_frequencies(attn.text, attn.plan.rope_theta, attn.plan.yarn)
    cache = cos_sin_cache(freqs, 64)
    positions = torch.arange(seq)
    o_rot = split_groups(inverse_rope_heads(attn_out[:, :heads], positions, cache), attn.groups)
    torch.testing.assert_close(o_rot, o_grouped[0], rtol=1e-5, atol=1e-5)
    base = grouped_o_proj_base(o_rot, attn.wo_a.weight.detach())
    delta = o_proj_lora_delta(attn_out, positions, cache, heads, attn.groups,
                              torch.zeros(seq, dtype=torch.long), _stacks_grouped(attn.wo_a))
    torch.testing.assert_close(base + delta, z_ref[0], rtol=1e-5, atol=1e-5)
    assert delta.abs().max() > 1e-3  # the adapter actually contributes


def test_two_adapters_in_one_batch_never_mix(forward_records):
    """Per-token slots: every token gets exactly its own adapter's output (or the base for slot -1)."""
    (m1, r1), (m2, _) = forward_records[11], forward_records[12]
    w1, w2 = m1.layers[2].attn.wo_a, m2.layers[2].attn.wo_a
    o = r1["2.wo_a"][0][0]  # [S, G, in_g]
    slots = torch.tensor([0, 1, -1, 1, 0, 0, -1, 1] * 3)
    delta = slot_grouped_lora_delta(o, slots, _stacks_grouped(w1, w2))
    with torch.no_grad():
        want = {0: w1(o[None])[0], 1: w2(o[None])[0]}
    base = grouped_o_proj_base(o, w1.weight.detach())
    for t, s in enumerate(slots.tolist()):
        expected = want[s][t] if s >= 0 else base[t]
        torch.testing.assert_close(base[t] + delta[t], expected, rtol=1e-5, atol=1e-6)


def test_grouped_delta_is_block_diagonal(forward_records):
    """Changing group g's input changes only group g's delta (no cross-group terms)."""
    model, rec = forward_records[11]
    wo_a = model.layers[2].attn.wo_a
    stacks = _stacks_grouped(wo_a)
    o = rec["2.wo_a"][0][0]
    slots = torch.zeros(o.shape[0], dtype=torch.long)
    before = slot_grouped_lora_delta(o, slots, stacks).view(o.shape[0], wo_a.groups, -1)
    bumped = o.clone()
    bumped[:, 1] += torch.randn_like(bumped[:, 1])
    after = slot_grouped_lora_delta(bumped, slots, stacks).view(o.shape[0], wo_a.groups, -1)
    torch.testing.assert_close(after[:, 0], before[:, 0], rtol=0, atol=0)
    assert not torch.allclose(after[:, 1], before[:, 1])


def test_shared_a_adapter_matches_reference():
    """A shared-A wo_a adapter (miles/NeMo layout) normalises to per-group factors with the same output."""
    model = _adapted_model(13, wo_a_lora="shared_a")
    wo_a = model.layers[0].attn.wo_a
    assert wo_a.lora_A.dim() == 2
    o = torch.randn(5, wo_a.groups, wo_a.in_per_group)
    delta = slot_grouped_lora_delta(o, torch.zeros(5, dtype=torch.long), _stacks_grouped(wo_a))
    with torch.no_grad():
        ref = wo_a(o[None]) - grouped_o_proj_base(o, wo_a.weight)[None]
    torch.testing.assert_close(delta, ref[0], rtol=1e-5, atol=1e-6)


def test_tensor_parallel_group_slices_cover_the_adapter(forward_records):
    """TP ranks own contiguous groups; concatenated rank deltas equal the full delta."""
    model, rec = forward_records[11]
    wo_a = model.layers[2].attn.wo_a
    a, b = grouped_factors(wo_a.lora_A.detach(), wo_a.lora_B.detach() * wo_a.scaling, wo_a.groups, wo_a.rank)
    o = rec["2.wo_a"][0][0]
    slots = torch.zeros(o.shape[0], dtype=torch.long)
    full = slot_grouped_lora_delta(o, slots, SlotStacks(a[None], b[None]))
    parts = []
    for rank in range(2):
        ra, rb = slice_groups(a, b, rank, 2)
        parts.append(slot_grouped_lora_delta(o[:, rank:rank + 1], slots, SlotStacks(ra[None], rb[None])))
    torch.testing.assert_close(torch.cat(parts, dim=-1), full, rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not split"):
        slice_groups(a, b, 0, 3)


def test_fp8_base_plus_delta_within_fp8_tolerance(forward_records):
    """FP8 wo_a base (release 32×32 E4M3 + dynamic FP8 activations) + exact delta vs dequantised base + ΔW."""
    from dsv4flash_bridge.codecs import decode_dense_fp8, encode_dense_fp8

    model, rec = forward_records[11]
    wo_a = model.layers[2].attn.wo_a
    codes, scale = encode_dense_fp8(wo_a.weight.detach(), name="layers.2.attn.wo_a.weight")
    dequant = decode_dense_fp8(codes, scale, dtype=torch.float32)
    o = rec["2.wo_a"][0][0]
    stacks = _stacks_grouped(wo_a)
    slots = torch.zeros(o.shape[0], dtype=torch.long)
    delta = slot_grouped_lora_delta(o, slots, stacks)
    served = grouped_o_proj_fp8_base(o, codes, scale, act_block=32) + delta
    merged = dequant + wo_a.delta_weight()  # [G·out_g, in_g]
    exact = grouped_o_proj_base(o, merged)
    rel = (served - exact).norm() / exact.norm()
    assert rel < 2**-4, f"FP8 serving error {rel:.4f} exceeds E4M3 activation tolerance"
    # the adapter contribution itself is exact: served - base_only == delta bit for bit
    torch.testing.assert_close(served - grouped_o_proj_fp8_base(o, codes, scale, act_block=32), delta,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layer", [2, 6])
def test_compressor_kv_score_equals_reference_projections(forward_records, layer):
    """fused [wkv ‖ wgate] score in fp32 with per-slice deltas == reference LoRA'd wkv / wgate (ratio 2 and 1)."""
    model, rec = forward_records[11]
    comp = model.layers[layer].attn.compressor
    x, kv_ref = rec[f"{layer}.wkv"]
    x = x.reshape(-1, x.shape[-1])
    pieces = [kv_ref.reshape(-1, kv_ref.shape[-1])]
    weights = [comp.wkv.weight.detach()]
    slices = [_stacks_linear(comp.wkv)]
    if comp.wgate is not None:
        pieces.append(rec[f"{layer}.wgate"][1].reshape(-1, kv_ref.shape[-1]))
        weights.append(comp.wgate.weight.detach())
        slices.append(_stacks_linear(comp.wgate))
    widths = [w.shape[0] for w in weights]
    score = compressor_kv_score(x, torch.cat(weights), torch.zeros(x.shape[0], dtype=torch.long), slices, widths)
    assert score.dtype == torch.float32
    torch.testing.assert_close(score, torch.cat(pieces, dim=-1).float(), rtol=1e-5, atol=1e-5)
    # without LoRA it is the plain fp32 projection
    plain = compressor_kv_score(x, torch.cat(weights))
    assert (score - plain).abs().max() > 1e-4


def test_compressor_slice_without_lora_is_untouched(forward_records):
    """A packed adapter that only adapts wkv leaves the wgate half of the score at the base value."""
    model, rec = forward_records[11]
    comp = model.layers[2].attn.compressor
    x = rec["2.wkv"][0].reshape(-1, comp.wkv.weight.shape[1])
    w = torch.cat([comp.wkv.weight, comp.wgate.weight]).detach()
    hd = comp.wkv.weight.shape[0]
    slots = torch.zeros(x.shape[0], dtype=torch.long)
    score = compressor_kv_score(x, w, slots, [_stacks_linear(comp.wkv), None], [hd, hd])
    torch.testing.assert_close(score[:, hd:], (x.float() @ w.float().t())[:, hd:], rtol=0, atol=0)


def test_multi_slot_linear_matches_each_adapter():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 8, 4, generator=gen)
    x = torch.randn(6, 16, generator=gen)
    slots = torch.tensor([2, 0, -1, 1, 2, 0])
    got = slot_lora_delta(x, slots, SlotStacks(a, b))
    for t, s in enumerate(slots.tolist()):
        want = torch.zeros(8) if s < 0 else b[s] @ (a[s] @ x[t])
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    a, b = torch.zeros(2, 4, 16), torch.zeros(2, 8, 4)
    with pytest.raises(ValueError, match="input features"):
        slot_lora_delta(torch.zeros(3, 15), torch.zeros(3, dtype=torch.long), SlotStacks(a, b))
    with pytest.raises(ValueError, match=r"token_slots must be \[T=3\]"):
        slot_lora_delta(torch.zeros(3, 16), torch.zeros(4, dtype=torch.long), SlotStacks(a, b))
    with pytest.raises(ValueError, match="layers.0.attn.wo_a"):
        grouped_factors(torch.zeros(4, 16), torch.zeros(7, 4), 2, 4, name="layers.0.attn.wo_a")
