"""Padding-safe modality routing on real megatron-core 0.19 (CPU, gloo): router, MoE layer, both dispatchers.

The oracle is the reference `dsv4flash.model.moe.Gate` (sqrtsoftplus, selection-only text/image bias,
normalised weights × route scale). Routed outputs are checked against Σ_k w_k·expert_k(x) computed from the
reference weights with Megatron's own expert modules, so the dispatch path is covered too.
"""

from __future__ import annotations

import contextlib
import pytest
import torch
import torch.nn.functional as F

from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.whole_machine]

DISPATCHERS = ("alltoall", "allgather")


# ---- builders (module level: the EP=2 ranks import them) -------------------------------------------
def v41_moe_config(text, **overrides):
    """fp32, fusion-free megatron-core config shaped like the tiny V4.1 MoE (sqrtsoftplus, route scale, clamp)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1, hidden_size=text.hidden_size, num_attention_heads=4, ffn_hidden_size=2 * text.hidden_size,
        num_moe_experts=text.n_routed_experts, moe_ffn_hidden_size=text.moe_intermediate_size,
        moe_router_topk=text.num_experts_per_tok, moe_router_topk_scaling_factor=text.routed_scaling_factor,
        moe_router_score_function="sqrtsoftplus", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall",
        gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=text.swiglu_limit,
        add_bias_linear=False, bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, bf16=False, fp16=False, use_cpu_initialization=True,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_moe(config, **router_options):
    """A `ModalityMoELayer` (local spec, sequential experts) built the way a layer spec builds it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from dsv4flash.integrations.mcore.router import with_modality_routing

    spec = with_modality_routing(get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                                          moe_grouped_gemm=False), **router_options)
    return spec.submodules.mlp(config=config)


def reference_gate(text, seed: int):
    """A reference Gate with random weight and biases large enough to change which experts win."""
    from dsv4flash.model.moe import Gate

    gen = torch.Generator().manual_seed(seed)
    gate = Gate(text, text.n_routed_experts, text.num_experts_per_tok, True, torch.float32, "cpu")
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen) * 0.2)
        gate.bias.copy_(torch.randn(gate.bias.shape, generator=gen) * 0.3)
        gate.bias_vl.copy_(torch.randn(gate.bias_vl.shape, generator=gen) * 0.3)
    return gate


def token_masks(seq: int, batch: int, seed: int):
    """[b, s] padding mask (tail padding of varying length) and image mask (one span per row, never on pads)."""
    gen = torch.Generator().manual_seed(seed)
    pad = torch.zeros(batch, seq, dtype=torch.bool)
    image = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        n_pad = int(torch.randint(0, seq // 2, (1,), generator=gen)) if b else 0
        if n_pad:
            pad[b, seq - n_pad:] = True
        start = int(torch.randint(0, seq // 2, (1,), generator=gen))
        image[b, start:start + seq // 3] = True
    return pad, image & ~pad


def expert_weights(moe):
    """Every expert's (fc1, fc2) weight, all-gathered over the expert-parallel group (global expert order)."""
    import torch.distributed as dist

    local = [(e.linear_fc1.weight.detach(), e.linear_fc2.weight.detach()) for e in moe.experts.local_experts]
    ep = moe.ep_group
    if ep.size() == 1:
        return local
    out = [None] * ep.size()
    dist.all_gather_object(out, local, group=ep)
    return [pair for rank_experts in out for pair in rank_experts]


def manual_moe(x_tokens, weights, idx, experts, limit):
    """Σ_k w_k · fc2(silu(min(g, L)) · clamp(u, ±L)) per token: the routed MoE written out token by token."""
    out = torch.zeros_like(x_tokens)
    for t in range(x_tokens.shape[0]):
        for w, e in zip(weights[t].tolist(), idx[t].tolist()):
            fc1, fc2 = experts[e]
            g, u = (x_tokens[t] @ fc1.t()).chunk(2)
            h = F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)
            out[t] += w * (h @ fc2.t())
    return out


def check_moe_against_reference(text, moe, gate, seq: int, batch: int, seed: int) -> None:
    """One MoE forward/backward with padding + image tokens, compared with the reference gate and experts."""
    from dsv4flash.integrations.mcore.router import copy_reference_gate

    copy_reference_gate(moe.router, gate)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, batch, text.hidden_size, generator=gen).requires_grad_()
    pad, image = token_masks(seq, batch, seed)
    moe.router.local_tokens_per_expert.zero_()
    moe.router.image_balance.local_tokens_per_expert.zero_()

    out, bias = moe(x, padding_mask=pad, image_mask=image)
    assert bias is None and out.shape == x.shape
    out.square().sum().backward()

    tokens = x.detach().transpose(0, 1).reshape(-1, text.hidden_size)  # [b·s, H], batch-major
    pad_t, image_t = pad.reshape(-1), image.reshape(-1)
    weights, idx = gate(tokens, image_t)
    want = manual_moe(tokens, weights, idx, expert_weights(moe), text.swiglu_limit)
    got = out.detach().transpose(0, 1).reshape(-1, text.hidden_size)
    torch.testing.assert_close(got[~pad_t], want[~pad_t], rtol=1e-5, atol=1e-5)
    # No shared expert here: a pad row gets exactly nothing, and sends no gradient back into x.
    assert torch.equal(got[pad_t], torch.zeros_like(got[pad_t]))
    grad = x.grad.transpose(0, 1).reshape(-1, text.hidden_size)
    assert torch.equal(grad[pad_t], torch.zeros_like(grad[pad_t]))
    assert grad[~pad_t].abs().sum() > 0 and moe.router.weight.grad.abs().sum() > 0

    # Counters: real text tokens in the text counter, real image tokens in the image counter, pads nowhere.
    hits = F.one_hot(idx, text.n_routed_experts).sum(1).float()  # [T, E]
    torch.testing.assert_close(moe.router.local_tokens_per_expert, hits[~pad_t & ~image_t].sum(0))
    torch.testing.assert_close(moe.router.image_balance.local_tokens_per_expert, hits[image_t].sum(0))


# ---- single rank ----------------------------------------------------------------------------------
@pytest.fixture()
def mp1():
    with parallel.model_parallel(seed=7):
        yield


def test_router_equals_reference_gate_on_real_rows(tiny_cfg, mp1):
    text = tiny_cfg.text
    moe = build_moe(v41_moe_config(text))
    gate = reference_gate(text, seed=1)
    from dsv4flash.integrations.mcore.router import copy_reference_gate

    copy_reference_gate(moe.router, gate)
    seq, batch = 16, 3
    x = torch.randn(seq, batch, text.hidden_size, generator=torch.Generator().manual_seed(2))
    pad, image = token_masks(seq, batch, seed=3)
    probs, routing_map = moe.router(x, pad.t(), image.t())  # router layout: [s, b]
    tokens = x.reshape(-1, text.hidden_size)  # [s·b, H], the router's token order
    pad_t, image_t = pad.t().reshape(-1), image.t().reshape(-1)
    weights, idx = gate(tokens, image_t)
    want = torch.zeros_like(probs).scatter(1, idx, weights)
    real = ~pad_t
    torch.testing.assert_close(probs[real], want[real], rtol=1e-6, atol=1e-7)
    assert torch.equal(routing_map[real], want[real] > 0)
    # The image bias really decides something here (the comparison above would not notice otherwise).
    _, idx_text_only = gate(tokens, torch.zeros_like(image_t))
    assert not torch.equal(idx[image_t], idx_text_only[image_t])
    # Pad rows: fixed k dispatcher rows, zero probability, spread over distinct experts.
    assert torch.equal(probs[pad_t], torch.zeros_like(probs[pad_t]))
    assert torch.equal(routing_map[pad_t].sum(-1), torch.full((int(pad_t.sum()),), text.num_experts_per_tok))
    assert routing_map.sum() == seq * batch * text.num_experts_per_tok


def test_padding_rows_are_spread_round_robin(tiny_cfg, mp1):
    text = tiny_cfg.text
    moe = build_moe(v41_moe_config(text))
    x = torch.zeros(8, 2, text.hidden_size)  # every pad row looks identical to the gate
    _, routing_map = moe.router(x, torch.ones(8, 2, dtype=torch.bool))
    per_expert = routing_map.sum(0)
    assert torch.equal(per_expert, torch.full_like(per_expert, 16 * text.num_experts_per_tok // text.n_routed_experts))


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_moe_layer_matches_reference_ep1(tiny_cfg, mp1, dispatcher):
    text = tiny_cfg.text
    moe = build_moe(v41_moe_config(text, moe_token_dispatcher_type=dispatcher))
    check_moe_against_reference(text, moe, reference_gate(text, seed=4), seq=12, batch=3, seed=5)


def test_counts_when_tokens_equal_experts(tiny_cfg, mp1):
    """T == E is where 0.19.2's `routing_map & ~padding_mask` silently masks experts instead of tokens."""
    text = tiny_cfg.text
    moe = build_moe(v41_moe_config(text))
    x = torch.randn(4, 2, text.hidden_size)  # T = 8 = E
    pad = torch.zeros(4, 2, dtype=torch.bool)
    pad[3, 1] = True
    _, routing_map = moe.router(x, pad)
    want = routing_map[~pad.reshape(-1)].sum(0).float()
    torch.testing.assert_close(moe.router.local_tokens_per_expert, want)
    assert moe.router.local_tokens_per_expert.sum() == 7 * text.num_experts_per_tok


def test_no_counting_without_grad(tiny_cfg, mp1):
    text = tiny_cfg.text
    moe = build_moe(v41_moe_config(text))
    with torch.no_grad():
        moe.router(torch.randn(4, 2, text.hidden_size))
    assert moe.router.local_tokens_per_expert.sum() == 0


@pytest.mark.parametrize("frozen", [True, False])
def test_stock_finalize_updates_each_bias_from_its_own_counts(tiny_cfg, mp1, frozen):
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )

    text = tiny_cfg.text
    config = v41_moe_config(text)
    moe = build_moe(config, freeze_expert_bias=frozen)
    copy_gate = reference_gate(text, seed=6)
    from dsv4flash.integrations.mcore.router import copy_reference_gate

    copy_reference_gate(moe.router, copy_gate)
    x = torch.randn(10, 2, text.hidden_size)
    pad, image = token_masks(10, 2, seed=7)
    moe.router(x, pad.t(), image.t())
    text_counts = moe.router.local_tokens_per_expert.clone()
    image_counts = moe.router.image_balance.local_tokens_per_expert.clone()
    assert text_counts.sum() > 0 and image_counts.sum() > 0
    before = (moe.router.expert_bias.clone(), moe.router.image_balance.expert_bias.clone())

    _update_router_expert_bias([moe], config)
    after = (moe.router.expert_bias, moe.router.image_balance.expert_bias)
    rate = config.moe_router_bias_update_rate
    for old, new, counts in zip(before, after, (text_counts, image_counts)):
        want = old if frozen else old + torch.sign(counts.mean() - counts) * rate
        torch.testing.assert_close(new, want, rtol=0, atol=0)
    reset_model_temporary_tensors(config, [moe])
    assert moe.router.local_tokens_per_expert.sum() == 0
    assert moe.router.image_balance.local_tokens_per_expert.sum() == 0


def test_bf16_cast_keeps_both_biases_exact_fp32(tiny_cfg, mp1):
    from megatron.core.transformer.module import Float16Module

    text = tiny_cfg.text
    config = v41_moe_config(text)
    moe = build_moe(config)
    torch.nn.init.normal_(moe.router.expert_bias, std=0.37)
    torch.nn.init.normal_(moe.router.image_balance.expert_bias, std=0.37)
    want = (moe.router.expert_bias.clone(), moe.router.image_balance.expert_bias.clone())
    wrapped = Float16Module(v41_moe_config(text, bf16=True), moe)
    router = wrapped.module.router
    assert router.weight.dtype == torch.bfloat16
    for got, exp in zip((router.expert_bias, router.image_balance.expert_bias), want):
        assert got.dtype == torch.float32 and torch.equal(got, exp)
    assert set(router.state_dict()) == {"weight", "expert_bias", "image_balance.expert_bias"}


def test_selective_moe_recompute_keeps_image_routing(tiny_cfg, mp1):
    text = tiny_cfg.text
    gate = reference_gate(text, seed=8)
    results = []
    for recompute in (False, True):
        extra = dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}
        torch.manual_seed(0)
        moe = build_moe(v41_moe_config(text, **extra))
        assert moe.moe_layer_recompute == recompute
        from dsv4flash.integrations.mcore.router import copy_reference_gate

        copy_reference_gate(moe.router, gate)
        x = torch.randn(9, 2, text.hidden_size, generator=torch.Generator().manual_seed(9)).requires_grad_()
        pad, image = token_masks(9, 2, seed=10)
        out, _ = moe(x, padding_mask=pad, image_mask=image)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, moe.router.weight.grad, moe.router.local_tokens_per_expert.clone(),
                        moe.router.image_balance.local_tokens_per_expert.clone()))
    for plain, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


def test_gpt_model_with_padding_mask_and_expert_bias(tiny_cfg, mp1):
    """The stock stack passes only padding_mask: it must run (0.19.2's TopKRouter raises here) with text bias."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from dsv4flash.integrations.mcore.router import with_modality_routing

    text = tiny_cfg.text
    config = v41_moe_config(text, num_layers=2)
    spec = with_modality_routing(get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                     position_embedding_type="rope")
    ids = torch.randint(0, 64, (2, 12))
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, 8:] = True
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]
    logits = model(ids, torch.arange(12).expand(2, 12), mask, padding_mask=pad)
    logits.float().sum().backward()
    routers = [layer.mlp.router for layer in model.decoder.layers]
    for router in routers:
        assert router.local_tokens_per_expert.sum() == 20 * text.num_experts_per_tok
        assert router.image_balance.local_tokens_per_expert.sum() == 0


def test_megatron_router_replay_records_and_replays_modality_routes(tiny_cfg, mp1):
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from dsv4flash.integrations.mcore.router import copy_reference_gate

    text = tiny_cfg.text
    moe = build_moe(v41_moe_config(text, moe_enable_routing_replay=True))
    try:
        copy_reference_gate(moe.router, reference_gate(text, seed=15))
        x = torch.randn(10, 2, text.hidden_size)
        pad, image = token_masks(10, 2, seed=16)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        _, recorded_map = moe.router(x, pad.t(), image.t())
        (recorded,) = RouterReplay.get_recorded_data()
        copy_reference_gate(moe.router, reference_gate(text, seed=17))  # a different gate would pick others
        _, fresh_map = moe.router(x, pad.t(), image.t())
        assert not torch.equal(fresh_map, recorded_map)
        RouterReplay.set_replay_data([recorded])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        replay_probs, replay_map = moe.router(x, pad.t(), image.t())
        assert torch.equal(replay_map, recorded_map)  # pad rows are re-spread identically
        assert torch.equal(replay_probs[pad.t().reshape(-1)], torch.zeros_like(replay_probs[pad.t().reshape(-1)]))
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_instances()


@pytest.mark.parametrize("bad, message", [
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function"),
    (dict(moe_router_enable_expert_bias=False), "moe_router_enable_expert_bias"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
])
def test_config_errors_name_the_key(tiny_cfg, mp1, bad, message):
    with pytest.raises(ValueError, match=message):
        build_moe(v41_moe_config(tiny_cfg.text, **bad))


def test_mask_shape_errors(tiny_cfg, mp1):
    text = tiny_cfg.text
    moe = build_moe(v41_moe_config(text))
    x = torch.randn(6, 2, text.hidden_size)
    with pytest.raises(ValueError, match="image_mask must be \\[b, s\\]"):
        moe(x, image_mask=torch.zeros(6, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding_mask must be \\[s, b\\]"):
        moe.router(x, torch.zeros(2, 6, dtype=torch.bool))


def test_spec_without_moe_is_rejected(mp1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from dsv4flash.integrations.mcore.router import with_modality_routing

    with pytest.raises(ValueError, match="no MoELayer"):
        with_modality_routing(get_gpt_layer_local_spec())


@contextlib.contextmanager
def real_cuda_model_parallel():
    """Model-parallel state on a real GPU: gloo world of one, no CUDA redirect."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_logging

    with parallel.gloo_group():
        parallel_state.initialize_model_parallel()
        try:
            model_parallel_cuda_manual_seed(7)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            moe_logging.set_moe_metrics_tracker(None)


@pytest.mark.gpu
def test_fused_router_matches_unfused(tiny_cfg):
    """TE's fused top-k takes one [E] bias: the router runs it once per modality and merges by row."""
    pytest.importorskip("transformer_engine")
    from dsv4flash.integrations.mcore.router import copy_reference_gate

    text = tiny_cfg.text
    gate = reference_gate(text, seed=13)
    x = torch.randn(16, 4, text.hidden_size).cuda()
    pad, image = token_masks(16, 4, seed=14)
    outs = []
    with real_cuda_model_parallel():
        for fused in (False, True):
            moe = build_moe(v41_moe_config(text, moe_router_fusion=fused)).cuda()
            copy_reference_gate(moe.router, gate)
            outs.append(moe.router(x, pad.t().cuda(), image.t().cuda()))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    assert torch.equal(outs[1][1], outs[0][1])


# ---- expert parallel, 2 ranks over gloo -------------------------------------------------------------
def _ep2_rank(rank: int, world_size: int, tiny_name: str) -> None:
    from dsv4flash.config import load_config

    text = load_config(tiny_name).text
    with parallel.model_parallel(ep=2, rank=rank, world_size=world_size, seed=11):
        gate = reference_gate(text, seed=12)  # same router on both ranks
        for dispatcher in DISPATCHERS:
            moe = build_moe(v41_moe_config(text, moe_token_dispatcher_type=dispatcher))
            assert moe.num_local_experts == text.n_routed_experts // 2
            check_moe_against_reference(text, moe, gate, seq=10, batch=2, seed=100 + rank)


def test_moe_layer_matches_reference_ep2_both_dispatchers():
    parallel.spawn_gloo(_ep2_rank, 2, "tiny")
