"""The reference follows the release kernels where bf16 rounding would otherwise differ (issue 18).

* sparse attention keeps the QK scores in fp32 (the release kernel accumulates and softmaxes in fp32);
* the straight-through quantizers return exactly the quantized value in the forward pass;
* the fake-quant points can be switched off for parity checks of computation orders;
* the indexer's top-k tie rule is switchable, and parity checks can compare picks up to ties.
"""

from __future__ import annotations

import torch

from dsv4flash.model.attention import sparse_attention, window_mask
from dsv4flash.model.indexer import (TIE_RULES, Indexer, same_selection_up_to_ties, tie_rule, topk_lowest_first,
                                     topk_select)
from dsv4flash.model.quant import (_fp4_e4m3_scaled, _fp4_pow2_scaled, _fp8_e4m3_blockwise, fake_quant,
                                   fake_quant_compressed_kv, fake_quant_index, fake_quant_window_kv)


def _fp32_logits_attention(q, keys, allowed, sink, scale):
    """Release semantics: fp32 scores and softmax (with the sink), probabilities cast to the activation dtype for PV."""
    b, s, h, d = q.shape
    logits = torch.empty(b, h, s, keys.shape[1])
    for hh in range(h):  # written per head with matmul, independent of the einsum in the reference
        logits[:, hh] = torch.matmul(q[:, :, hh].float(), keys.float().transpose(1, 2)) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    full = torch.cat([logits, sink.float().view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    probs = torch.softmax(full, dim=-1)[..., :-1]
    return torch.einsum("bhsk,bkd->bshd", probs.to(q.dtype), keys.to(q.dtype)), logits


def test_bf16_sparse_attention_keeps_the_scores_in_fp32():
    g = torch.Generator().manual_seed(0)
    seq, heads, dim = 24, 4, 512  # the release head dim: long dot products, where bf16 scores round the most
    q = (torch.randn(1, seq, heads, dim, generator=g) * 0.6).bfloat16()
    keys = (torch.randn(1, seq, dim, generator=g) * 0.6).bfloat16()
    sink = torch.randn(heads, generator=g)
    allowed = window_mask(seq, 16, "cpu").expand(1, seq, seq)
    out = sparse_attention(q, keys, allowed, sink, dim**-0.5)
    expected, _ = _fp32_logits_attention(q, keys, allowed, sink, dim**-0.5)
    # bf16 scores put outputs one bf16 step (3.9e-3) off here; fp32 scores leave only the PV product, computed alike
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=1e-3)


def test_fp32_sparse_attention_is_unchanged_by_the_fp32_scores():
    g = torch.Generator().manual_seed(1)
    q, keys = torch.randn(2, 8, 2, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    sink = torch.randn(2, generator=g)
    allowed = window_mask(8, 4, "cpu").expand(2, 8, 8)
    logits = torch.einsum("bshd,bkd->bhsk", q, keys) * 0.25  # the fp32 computation before the change
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(torch.cat([logits, sink.view(1, -1, 1, 1).expand(2, 2, 8, 1)], -1), -1)[..., :-1]
    assert torch.equal(sparse_attention(q, keys, allowed, sink, 0.25), torch.einsum("bhsk,bkd->bshd", probs, keys))


def _saturated_block(dtype=torch.bfloat16) -> torch.Tensor:
    """One 16-lane NVFP4 block whose amax/6 exceeds E4M3's 448: the scale saturates and -36096 maps to -2688."""
    x = torch.zeros(1, 32, dtype=dtype)
    x[0, 0], x[0, 1], x[0, 16] = -36096.0, 12.5, 3.0
    return x


def test_saturated_nvfp4_block_is_value_exact_in_the_forward():
    x = _saturated_block().requires_grad_()
    y = fake_quant_compressed_kv(x)
    assert y[0, 0].item() == -2688.0  # x + (q - x).detach() gives -2816 here in bf16
    assert torch.equal(y.detach(), _fp4_e4m3_scaled(x.detach(), 16))


def test_every_quantizer_returns_exactly_q_and_passes_the_gradient_straight_through():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(8, 64, generator=g) * torch.logspace(0, 5, 64)).bfloat16().requires_grad_()
    for fake, exact in ((fake_quant_window_kv, lambda t: _fp8_e4m3_blockwise(t, 32)),
                        (fake_quant_compressed_kv, lambda t: _fp4_e4m3_scaled(t, 16)),
                        (fake_quant_index, lambda t: _fp4_pow2_scaled(t, 32))):
        x.grad = None
        y = fake(x)
        assert torch.equal(y.detach(), exact(x.detach())), fake.__name__
        cotangent = torch.randn(y.shape, generator=g).bfloat16()
        (y * cotangent).sum().backward()
        assert torch.equal(x.grad, cotangent), fake.__name__
    with torch.no_grad():
        assert not fake_quant_index(x).requires_grad


def test_fake_quant_off_passes_values_through_inside_the_block_only():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    points = (fake_quant_window_kv, fake_quant_compressed_kv, fake_quant_index)
    quantized = [fake(x) for fake in points]
    assert all(not torch.equal(q, x) for q in quantized)
    try:
        with fake_quant(False):
            assert all(fake(x) is x for fake in points)
            with fake_quant(True):
                assert torch.equal(fake_quant_index(x), quantized[2])
            assert fake_quant_index(x) is x
            raise KeyError("leave the block by an exception")
    except KeyError:
        pass
    assert all(torch.equal(fake(x), q) for fake, q in zip(points, quantized))


def test_tie_rules_pick_the_same_scores_and_differ_only_among_ties():
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 2.0, 0.0, 1.0, float("-inf")]] * 3)
    with tie_rule("kernel"):
        kernel = topk_select(scores, 5)[1]
    lowest = topk_lowest_first(scores, 5)[1]
    assert torch.equal(topk_select(scores, 5)[1], lowest)  # the default rule
    assert lowest[0].tolist() == [1, 4, 6, 0, 2]
    assert same_selection_up_to_ties(scores, kernel, lowest)
    other = lowest.clone()
    other[0, 4] = 7  # a -inf slot instead of a tied 0.0 one: a real difference
    assert not same_selection_up_to_ties(scores, other, lowest)
    assert TIE_RULES == ("lowest_first", "kernel")


def test_indexer_follows_the_active_tie_rule():
    from dsv4flash.config import load_config

    indexer = Indexer(load_config("tiny").text, owns_keys=False, dtype=torch.float32, device=None)
    scores = torch.zeros(1, 8, 4)  # all tied: only the rule decides
    scores[0, :, 3] = -1.0
    picks = {}
    for rule in TIE_RULES:
        with tie_rule(rule):
            picks[rule] = indexer.select(scores, 2)
    assert picks["lowest_first"][0, -1].tolist() == list(range(min(indexer.topk, 4)))[: picks["lowest_first"].shape[-1]]
    assert same_selection_up_to_ties(scores, picks["kernel"], picks["lowest_first"])
    try:
        with tie_rule("random"):
            raise AssertionError("an unknown rule was accepted")
    except ValueError as exc:
        assert "tie rule must be one of" in str(exc)


def test_fp32_quantizers_give_the_bits_of_the_old_straight_through_sum():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 64, generator=g)  # activation magnitudes: the fp32 sum x + (q - x) is exact there
    for exact in (lambda t: _fp8_e4m3_blockwise(t, 32), lambda t: _fp4_e4m3_scaled(t, 16),
                  lambda t: _fp4_pow2_scaled(t, 32)):
        q = exact(x)
        assert torch.equal(x + (q - x), q)
