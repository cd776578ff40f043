"""Invariants of the reference model that docs/architecture.md states (§14, tiny config, CPU)."""

from __future__ import annotations

import pytest
import torch

from dsv4flash.model.hyper_connection import HyperConnectionSite, sinkhorn
from dsv4flash.model.moe import Gate
from dsv4flash.model.state import CSA2State
from dsv4flash.model.transformer import Transformer


def _ids(batch=2, seq=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (batch, seq), generator=gen)


def _states_by_layer(model, ids):
    streams, pre_mix, ctx = model.embed_inputs(ids)
    state, seen = CSA2State(), []
    for block in model.layers:
        streams, pre_mix, state = block(streams, pre_mix, state, ctx)
        seen.append(state)
    return seen


def test_reuse_layer_reads_the_most_recent_source(tiny_model):
    states = _states_by_layer(tiny_model, _ids(1, 16))
    assert [s.kv_layer for s in states] == [-1, -1, 2, 2, 4, 4, 6, 6, 6, 6, 6, 6]
    assert [s.topk_layer for s in states] == [-1, -1, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    assert [s.candidate_layer for s in states][6:] == [6] * 6
    # Layer 5 refuses a state that still holds layer 2's compressed KV (it must read layer 4's).
    streams, pre_mix, ctx = tiny_model.embed_inputs(_ids(1, 16))
    with pytest.raises(RuntimeError, match="expected compressed KV of layer 4"):
        tiny_model.layers[5](streams, pre_mix, states[3], ctx)


def test_wgate_only_on_ratio_above_one_sources(tiny_model):
    for block in tiny_model.layers:
        comp = block.attn.compressor
        assert (comp is not None) == (block.plan.mode == "full")
        if comp is not None:
            assert (comp.wgate is not None) == (block.plan.ratio > 1)
        idx = block.attn.indexer
        assert (idx is not None) == block.plan.has_indexer
        if idx is not None:
            assert (idx.wk is not None) == (block.plan.mode == "full")


def test_compressor_pools_with_a_channelwise_softmax(tiny_model):
    comp = tiny_model.layers[2].attn.compressor
    x = torch.randn(1, 7, 64)
    latents = comp(x)
    assert latents.shape == (1, 3, 32)  # the trailing incomplete group yields nothing
    v, s = comp.wkv(x[:, :6]), comp.wgate(x[:, :6])
    w = torch.softmax(s.view(1, 3, 2, 32), dim=2)
    torch.testing.assert_close(latents, comp.norm((w * v.view(1, 3, 2, 32)).sum(2)))
    comp1 = tiny_model.layers[6].attn.compressor
    torch.testing.assert_close(comp1(x), comp1.norm(comp1.wkv(x)))


def test_bias_changes_selection_not_weights(tiny_cfg):
    gate = Gate(tiny_cfg.text, n_experts=8, topk=2, with_bias_vl=True, dtype=torch.float32, device=None)
    torch.nn.init.normal_(gate.weight, std=0.5)
    x = torch.randn(32, 64)
    weights0, idx0 = gate(x)
    with torch.no_grad():
        gate.bias[5] = 100.0
    weights1, idx1 = gate(x)
    assert (idx1 == 5).any(-1).all() and not (idx0 == 5).any(-1).all()
    scores = gate.scores(x)
    expected = scores.gather(-1, idx1)
    torch.testing.assert_close(weights1, expected / expected.sum(-1, keepdim=True) * 1.5)
    # Rows whose selection the bias did not change keep bit-identical weights.
    same = (idx0.sort(-1).values == idx1.sort(-1).values).all(-1)
    order0, order1 = idx0.argsort(-1), idx1.argsort(-1)
    assert torch.equal(weights0.gather(-1, order0)[same], weights1.gather(-1, order1)[same])


def test_bias_vl_applies_only_to_image_span_tokens(tiny_cfg):
    gate = Gate(tiny_cfg.text, n_experts=8, topk=2, with_bias_vl=True, dtype=torch.float32, device=None)
    torch.nn.init.normal_(gate.weight, std=0.5)
    with torch.no_grad():
        gate.bias_vl[7] = 100.0
        gate.bias[7] = -100.0
    image = torch.tensor([True, False] * 16)
    _, idx = gate(torch.randn(32, 64), image)
    assert (idx[image] == 7).any(-1).all()
    assert not (idx[~image] == 7).any()


def test_sinkhorn_output_is_doubly_stochastic():
    for spread, row_tol in ((1.0, 1e-3), (3.0, 2e-2)):  # 20 iterations: rows converge, columns are exact
        comb = sinkhorn(torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(0)) * spread, 20, 1e-6)
        torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), atol=1e-5, rtol=0)
        torch.testing.assert_close(comb.sum(-1), torch.ones(5, 4), atol=row_tol, rtol=0)
        assert (comb > 0).all()


def test_mhc_coefficient_ranges(tiny_cfg):
    site = HyperConnectionSite(tiny_cfg.text)
    x = torch.randn(2, 3, 4, 64)
    fn = torch.randn(24, 256)
    pre, post, comb = site(x, fn, torch.randn(24), torch.ones(3) * 4)
    assert ((pre >= 1e-6) & (pre <= 1 + 1e-6)).all()  # sigmoid + ε, not normalised
    assert ((post >= 0) & (post <= 2)).all() and post.max() > 1.5  # 2·sigmoid: above 1 is reachable
    assert comb.shape == (2, 3, 4, 4)


def test_source_compressor_gets_gradient_through_consumers_only(tiny_model):
    """Detach the hidden streams after the kv source: only the shared state links it to its consumers."""
    for source, consumers in ((2, (3,)), (6, (7, 8, 9, 10, 11))):
        tiny_model.zero_grad()
        streams, pre_mix, ctx = tiny_model.embed_inputs(_ids(1, 32))
        streams, pre_mix, state = tiny_model.run_layers(streams, pre_mix, CSA2State(), ctx, 0, source + 1)
        streams, pre_mix = streams.detach(), pre_mix.detach()
        streams, pre_mix, state = tiny_model.run_layers(streams, pre_mix, state, ctx, source + 1, consumers[-1] + 1)
        streams.pow(2).mean().backward()
        comp = tiny_model.layers[source].attn.compressor
        assert comp.wkv.weight.grad is not None and comp.wkv.weight.grad.abs().sum() > 0
        if comp.wgate is not None:  # straight-through fake-quant keeps the gate's gradient alive
            assert comp.wgate.weight.grad.abs().sum() > 0


def test_indexer_parameters_get_no_gradient_and_the_rest_does(tiny_model):
    logits = tiny_model(_ids())
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), _ids()[:, 1:].flatten()).backward()
    for name, param in tiny_model.named_parameters():
        if ".indexer." in name or name.endswith(("gate.bias", "gate.bias_vl")):
            assert param.grad is None or param.grad.abs().sum() == 0, name
        elif not name.startswith(("vision.", "aligner.", "image_", "layers.")):
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert tiny_model.layers[4].attn.compressor.wgate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("seq", [64, 63])
def test_causality_changing_a_later_token_never_changes_earlier_outputs(tiny_model, seq):
    ids = _ids(1, seq)
    with torch.no_grad():
        base = tiny_model(ids)
        for t in (0, 5, 7, 8, 31, seq - 2):
            changed = ids.clone()
            changed[0, t + 1] = (changed[0, t + 1] + 17) % 500
            out = tiny_model(changed)
            # Not bitwise: the expert GEMMs see a different number of routed rows when token t+1 changes
            # its experts, which changes BLAS blocking (last-ulp noise, ~1e-8). A leak is orders larger.
            leak = (out[:, : t + 1] - base[:, : t + 1]).abs().max()
            assert leak < 1e-5, f"token {t + 1} leaked into positions <= {t} (max change {leak:.2e})"
            assert (out[:, t + 1] - base[:, t + 1]).abs().max() > 1e-3


def test_determinism_under_a_fixed_seed(tiny_cfg):
    ids = _ids()
    a, b = Transformer(tiny_cfg, seed=3), Transformer(tiny_cfg, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))
        assert not torch.equal(a(ids), Transformer(tiny_cfg, seed=4)(ids))


def test_batch_rows_are_independent(tiny_model):
    ids = _ids(3, 48)
    with torch.no_grad():
        together = tiny_model(ids)
        for row in range(3):
            torch.testing.assert_close(tiny_model(ids[row:row + 1])[0], together[row], rtol=1e-5, atol=1e-5)


def test_topk_is_sorted_reachable_and_uses_the_candidate_pool(tiny_model):
    states = _states_by_layer(tiny_model, _ids(2, 64))
    for layer in (2, 6, 8, 10):
        topk = states[layer].topk  # [B,S,k]
        ratio = tiny_model.layers[layer].plan.ratio
        reach = (torch.arange(64) + 1) // ratio
        valid = topk >= 0
        assert (topk[valid] < reach.view(1, -1, 1).expand_as(topk)[valid]).all()
        as_pos = torch.where(valid, topk, torch.full_like(topk, 10**6))
        assert (as_pos.sort(-1).values == as_pos).all()  # re-sorted by position; unreachable picks (−1) last
        assert topk.shape[-1] == min(8, 64 // ratio)
        # early queries reach fewer than k positions: the rest are −1
        assert (valid.sum(-1)[:, :4] == reach[:4].clamp(max=8)).all()
    pool = states[6].candidates  # [B,S,T]
    newest_block = (torch.arange(64)) // 4
    assert pool.gather(-1, (newest_block * 4).view(1, -1, 1).expand(2, -1, 1)).all()  # newest block pinned
    assert (pool.sum(-1) <= 12).all() and (pool[:, 20:].sum(-1) >= 9).all()
    # Reindex layers pick only inside the pool of layer 6 (when it holds at least k positions).
    for layer in (8, 10):
        topk = states[layer].topk
        picked = torch.zeros_like(pool)
        picked.scatter_(-1, topk.clamp(min=0), topk >= 0)
        assert not (picked & ~pool).any()
