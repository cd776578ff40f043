# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core.models.gpt.hyper_connection_layer_specs import (
    get_hyper_connection_layer_local_spec,
)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.hyper_connection import HyperConnectionTransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlock
from tests.unit_tests.test_utilities import Utils

SEQ, BATCH, HIDDEN, STREAMS = 6, 2, 32, 3


def _block(**kwargs):
    config = HyperConnectionTransformerConfig(
        num_layers=3,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        hc_mult=STREAMS,
        hc_sinkhorn_iters=5,
        **kwargs,
    )
    return TransformerBlock(config, get_hyper_connection_layer_local_spec()).cuda()


def _coefficients(site, streams, config):
    """pre, post [n] and comb [n, n] of one token's streams [n, h], written out term by term."""
    n = config.hc_mult
    flat = streams.reshape(-1)
    mix = site.fn @ flat / torch.sqrt((flat * flat).mean() + config.layernorm_epsilon)
    pre = torch.sigmoid(mix[:n] * site.scale[0] + site.base[:n]) + config.hc_eps
    post = 2 * torch.sigmoid(mix[n : 2 * n] * site.scale[1] + site.base[n : 2 * n])
    comb = torch.softmax((mix[2 * n :] * site.scale[2] + site.base[2 * n :]).view(n, n), dim=-1)
    comb = comb + config.hc_eps
    comb = comb / (comb.sum(0, keepdim=True) + config.hc_eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(1, keepdim=True) + config.hc_eps)
        comb = comb / (comb.sum(0, keepdim=True) + config.hc_eps)
    return pre, post, comb


def _site(site, streams, sublayer, pre, config):
    """One mHC site over every token: returns the new streams and this site's pre."""
    coeffs = [[_coefficients(site, streams[i, b], config) for b in range(BATCH)] for i in range(SEQ)]
    collapsed = torch.stack([torch.stack([pre[i][b] @ streams[i, b] for b in range(BATCH)]) for i in range(SEQ)])
    y = sublayer(collapsed)  # [s, b, h]
    new = torch.empty_like(streams)
    new_pre = [[None] * BATCH for _ in range(SEQ)]
    for i in range(SEQ):
        for b in range(BATCH):
            p, post, comb = coeffs[i][b]
            for j in range(config.hc_mult):
                mixed = sum(comb[k, j] * streams[i, b, k] for k in range(config.hc_mult))
                new[i, b, j] = post[j] * y[i, b] + mixed
            new_pre[i][b] = p
    return new, new_pre


def _reference(block, hidden, mask):
    config = block.config
    streams = hidden.unsqueeze(2).repeat(1, 1, config.hc_mult, 1)  # [s, b, n, h]
    pre = [[torch.eye(config.hc_mult)[0].cuda()] * BATCH for _ in range(SEQ)]
    for layer in block.layers:

        def attention(x):
            return layer.self_attention(layer.input_layernorm(x), attention_mask=mask)[0]

        def mlp(x):
            return layer.mlp(layer.pre_mlp_layernorm(x))[0]

        streams, pre = _site(layer.self_attn_hyper_connection, streams, attention, pre, config)
        streams, pre = _site(layer.mlp_hyper_connection, streams, mlp, pre, config)
    collapsed = torch.stack(
        [torch.stack([pre[i][b] @ streams[i, b] for b in range(BATCH)]) for i in range(SEQ)]
    )
    return block.final_layernorm(collapsed)


class TestHyperConnectionTransformerLayer:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_stack_matches_plain_computation(self):
        block = _block()
        hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda"), diagonal=1)[None, None]
        out = block(hidden, attention_mask=mask)
        with torch.no_grad():
            expected = _reference(block, hidden, mask)
        assert out.shape == (SEQ, BATCH, HIDDEN)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("method, num_layers", [("uniform", 1), ("block", 2)])
    def test_full_recompute_matches(self, method, num_layers):
        reference = _block()
        block = _block(
            recompute_granularity="full", recompute_method=method, recompute_num_layers=num_layers
        )
        block.load_state_dict(reference.state_dict())
        hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda"), diagonal=1)[None, None]
        grads = []
        for model in (reference, block):
            inputs = hidden.clone().requires_grad_(True)
            model(inputs, attention_mask=mask).square().sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
            grads[-1]["input"] = inputs.grad
        assert grads[0]["layers.0.self_attn_hyper_connection.fn"].abs().sum() > 0
        for name, grad in grads[0].items():
            torch.testing.assert_close(grads[1][name], grad, msg=name)

    def test_coefficients_stay_fp32_under_a_half_precision_cast(self):
        block = _block()
        site = block.layers[0].self_attn_hyper_connection
        before = {name: param.detach().clone() for name, param in site.named_parameters()}
        block.bfloat16()
        assert block.layers[0].self_attention.linear_proj.weight.dtype == torch.bfloat16
        for name, param in site.named_parameters():
            assert param.dtype == torch.float32, name
            assert torch.equal(param, before[name]), name


def test_stage_payload_round_trip():
    from megatron.core.transformer.hyper_connection import decode_stage_payload, encode_stage_payload

    streams = torch.randn(6, 1, 8).to(torch.bfloat16).requires_grad_(True)
    pre = torch.rand(6, 1, 4, requires_grad=True)
    keys = torch.randn(1, 3, 16, requires_grad=True)
    topk = torch.tensor([[[0, 2, -1]] * 6])
    payload = encode_stage_payload((streams, pre, None, keys, topk), meta=(2, 14))
    assert payload.dtype == torch.float32 and payload.shape[1:] == (1, 1)
    received = payload.detach().requires_grad_(True)
    (got_streams, got_pre, none, got_keys, got_topk), meta = decode_stage_payload(received, detach=(3,))
    assert meta == (2, 14) and none is None and not got_keys.requires_grad
    assert got_streams.dtype == torch.bfloat16 and torch.equal(got_streams, streams)
    assert torch.equal(got_pre, pre) and torch.equal(got_keys, keys) and torch.equal(got_topk, topk)
    for part in (got_pre, got_keys):  # views of the payload, each on a 64-byte boundary of it
        assert part.data_ptr() != received.data_ptr() and (part.data_ptr() - received.data_ptr()) % 64 == 0
    got_pre.sum().backward()
    payload.backward(received.grad)
    assert torch.equal(pre.grad, torch.ones_like(pre)) and not keys.grad.any()
    with pytest.raises(ValueError, match="header"):
        decode_stage_payload(payload[:4])
