"""Numerics of the reference pieces: fake-quant points, RoPE/YaRN, sink attention, grouped wo_a."""

from __future__ import annotations

import math

import torch

from dsv4flash.config import load_config
from dsv4flash.model.attention import GroupedOutputProjection, sparse_attention, window_mask
from dsv4flash.model.quant import (
    fake_quant_compressed_kv,
    fake_quant_index,
    fake_quant_window_kv,
    pow2_scale,
    round_e2m1,
)
from dsv4flash.model.rope import apply_rope, rope_angles, rope_frequencies


def test_e2m1_rounds_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.75, -5.0, 0.3, 2.9])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.0, -4.0, 0.5, 3.0])
    out = round_e2m1(x)
    assert torch.equal(out, expected) and torch.equal(torch.signbit(out), torch.signbit(expected))


def test_pow2_scale_rounds_up_from_exponent_bits():
    amax = torch.tensor([448.0, 449.0, 1.0, 6.0, 6.5])
    assert torch.equal(pow2_scale(amax[:3], 448.0), torch.tensor([1.0, 2.0, 2.0**-8]))
    assert torch.equal(pow2_scale(amax[3:], 6.0), torch.tensor([1.0, 2.0]))


def test_window_kv_fp8_blocks_and_straight_through_gradient():
    x = torch.randn(2, 3, 64, requires_grad=True)
    y = fake_quant_window_kv(x)
    blocks = y.detach().view(2, 3, 2, 32)
    scale = pow2_scale(x.detach().view(2, 3, 2, 32).abs().amax(-1, keepdim=True).clamp(min=1e-4), 448.0)
    codes = blocks / scale
    assert torch.equal(codes, codes.to(torch.float8_e4m3fn).float())  # every value is an E4M3 code × 2^k
    assert (y.detach() - x.detach()).abs().max() <= x.detach().abs().max() * 2**-4
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_compressed_kv_and_index_fp4_points():
    x = torch.randn(4, 64)
    kv = fake_quant_compressed_kv(x).view(4, 4, 16)
    scale = (x.view(4, 4, 16).abs().amax(-1, keepdim=True) / 6).to(torch.float8_e4m3fn).float()
    assert torch.equal(round_e2m1(kv / scale), kv / scale)
    idx = fake_quant_index(x).view(4, 2, 32)
    s = pow2_scale(x.view(4, 2, 32).abs().amax(-1, keepdim=True), 6.0)
    assert torch.equal(round_e2m1(idx / s), idx / s)


def test_yarn_band_for_release_and_tiny():
    for flavour, low, high, factor in (("flash", 15, 25, 16), ("tiny", 0, 1, 4)):
        text = load_config(flavour).text
        plain = rope_frequencies(text, text.compress_rope_theta, yarn=False)
        yarn = rope_frequencies(text, text.compress_rope_theta, yarn=True)
        assert torch.equal(yarn[: low + 1], plain[: low + 1])
        torch.testing.assert_close(yarn[high:], plain[high:] / factor)
    tiny = load_config("tiny").text
    assert torch.equal(rope_frequencies(tiny, 10000.0, yarn=False),
                       1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))


def test_rope_is_interleaved_on_the_tail_and_inverts():
    text = load_config("tiny").text
    rot = rope_angles(rope_frequencies(text, 10000.0, False), torch.arange(5))
    x = torch.randn(1, 5, 3, 32)
    y = apply_rope(x, rot)
    assert torch.equal(y[..., :24], x[..., :24])
    a, b = x[0, 3, 0, 24], x[0, 3, 0, 25]
    angle = 3 * 1.0  # position 3, first frequency 1
    torch.testing.assert_close(y[0, 3, 0, 24], a * math.cos(angle) - b * math.sin(angle))
    torch.testing.assert_close(apply_rope(y, rot, inverse=True), x, atol=1e-6, rtol=0)


def test_sparse_attention_matches_the_sink_formula():
    q, keys = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 8)
    sink = torch.tensor([0.3, -1.0])
    allowed = window_mask(6, 3, "cpu").expand(1, 6, 6)
    out = sparse_attention(q, keys, allowed, sink, 0.5)
    i, h = 4, 1
    s = torch.stack([q[0, i, h] @ keys[0, t] * 0.5 for t in (2, 3, 4)])
    p = torch.exp(s) / (torch.exp(s).sum() + torch.exp(sink[h]))
    torch.testing.assert_close(out[0, i, h], (p[:, None] * keys[0, 2:5]).sum(0))


def test_grouped_output_projection_is_block_diagonal():
    proj = GroupedOutputProjection(groups=2, in_per_group=6, rank=4, dtype=torch.float32, device=None)
    torch.nn.init.normal_(proj.weight)
    o = torch.randn(1, 3, 2, 6)
    dense = torch.block_diag(proj.weight[:4], proj.weight[4:])  # [8, 12]
    torch.testing.assert_close(proj(o), o.flatten(-2) @ dense.t())


def test_index_selection_breaks_ties_toward_the_lower_position():
    from dsv4flash.model.indexer import topk_lowest_first

    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, float("-inf")]])
    values, indices = topk_lowest_first(scores, 4)
    assert indices.tolist() == [[1, 4, 0, 2]] and values.tolist() == [[1.0, 1.0, 0.0, 0.0]]
