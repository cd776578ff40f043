# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import math

import pytest
import torch

from megatron.core.models.gpt.csa2_layer_specs import get_csa2_decoder_block_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.experimental_attention_variant.csa2 import CSA2TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlock
from tests.unit_tests.test_utilities import Utils

SEQ, BATCH, HIDDEN = 12, 2, 32


def _config(**kwargs):
    return CSA2TransformerConfig(
        num_layers=5,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        kv_channels=16,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        hc_mult=2,
        csa2_layer_pattern="SFPIR",
        csa2_compress_ratios=[0, 2, 0, 0, 0],
        csa2_q_lora_rank=16,
        csa2_rope_dim=8,
        csa2_sliding_window=4,
        csa2_output_groups=2,
        csa2_output_rank=8,
        csa2_index_heads=2,
        csa2_index_head_dim=8,
        csa2_index_topk=3,
        csa2_candidate_block_size=2,
        csa2_candidate_topk_blocks=2,
        **kwargs,
    )


# ---- a plain, per-token computation of the same model --------------------------------------------
def _rms(x, weight, eps):
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta, rope_dim, inverse=False):
    """Rotate the interleaved pairs of the last rope_dim lanes of x [..., d] at integer position pos."""
    out = x.clone()
    d = x.shape[-1]
    for p in range(rope_dim // 2):
        angle = pos * theta ** (-2 * p / rope_dim) * (-1 if inverse else 1)
        c, s = math.cos(angle), math.sin(angle)
        a, b = x[..., d - rope_dim + 2 * p], x[..., d - rope_dim + 2 * p + 1]
        out[..., d - rope_dim + 2 * p] = a * c - b * s
        out[..., d - rope_dim + 2 * p + 1] = a * s + b * c
    return out


def _coefficients(hc, streams, cfg):
    n = cfg.hc_mult
    flat = streams.reshape(-1)
    mix = hc.fn @ flat / torch.sqrt((flat * flat).mean() + cfg.layernorm_epsilon)
    pre = torch.sigmoid(mix[:n] * hc.scale[0] + hc.base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mix[n : 2 * n] * hc.scale[1] + hc.base[n : 2 * n])
    comb = torch.softmax((mix[2 * n :] * hc.scale[2] + hc.base[2 * n :]).view(n, n), dim=-1)
    comb = comb + cfg.hc_eps
    comb = comb / (comb.sum(0, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(0, keepdim=True) + cfg.hc_eps)
    return pre, post, comb


def _top(scores, k):
    """Indices of the k largest finite scores, ties to the lower index, sorted by index."""
    order = sorted(range(len(scores)), key=lambda t: (-scores[t], t))
    return sorted(t for t in order[:k] if scores[t] > -math.inf)


def _reference(block, x):
    """x [s, b, h] -> [s, b, h], one sequence and one token at a time."""
    cfg = block.config
    eps, n, ratio = cfg.layernorm_epsilon, cfg.hc_mult, 2
    out = torch.empty_like(x)
    for b in range(x.shape[1]):
        streams = [torch.stack([x[i, b]] * n) for i in range(SEQ)]
        pre = [torch.eye(n)[0] for _ in range(SEQ)]
        compressed = index_keys = topk = pool = None
        for layer in block.layers:
            attn, kind = layer.self_attention, layer.self_attention.role.kind
            theta = cfg.csa2_rope_theta if kind == "S" else cfg.csa2_compressed_rope_theta
            rope = lambda v, p, inv=False: _rope(v, p, theta, cfg.csa2_rope_dim, inv)
            coeffs = [_coefficients(layer.self_attn_hyper_connection, streams[i], cfg) for i in range(SEQ)]
            h = [_rms(pre[i] @ streams[i], layer.input_layernorm.weight, eps) for i in range(SEQ)]
            q_lat = [_rms(attn.linear_q_down.weight @ h[i], attn.q_layernorm.weight, eps) for i in range(SEQ)]
            keys = [rope(_rms(attn.linear_kv.weight @ h[i], attn.kv_layernorm.weight, eps), i) for i in range(SEQ)]
            if kind == "F":
                comp = attn.compressor
                compressed, index_keys, pool = [], [], None
                for g in range(SEQ // ratio):
                    members = h[g * ratio : (g + 1) * ratio]
                    values = torch.stack([comp.linear_kv.weight @ m for m in members])
                    gates = torch.softmax(torch.stack([comp.linear_gate.weight @ m for m in members]), 0)
                    latent = _rms((gates * values).sum(0), comp.norm.weight, eps)
                    compressed.append(rope(latent, g * ratio))
                    k = attn.indexer.k_layernorm.weight
                    index_keys.append(rope(_rms(attn.indexer.linear_k.weight @ latent, k, eps), g * ratio))
            if kind in "FPI":
                idx, new_topk, new_pool = attn.indexer, [], []
                for i in range(SEQ):
                    q = (idx.linear_q.weight @ q_lat[i]).view(idx.heads, idx.head_dim)
                    q = torch.stack([rope(qh, i) for qh in q])
                    w = idx.linear_weights.weight @ h[i] * idx.weight_scale
                    reach = (i + 1) // ratio
                    scores = [
                        float((w * torch.relu(q @ index_keys[t])).sum()) if t < reach else -math.inf
                        for t in range(len(compressed))
                    ]
                    if kind == "P":
                        bs, blocks = cfg.csa2_candidate_block_size, -(-len(scores) // cfg.csa2_candidate_block_size)
                        best = [max(scores[j * bs : (j + 1) * bs]) for j in range(blocks)]
                        if reach:
                            best[(reach - 1) // bs] = math.inf
                        chosen = _top(best, cfg.csa2_candidate_topk_blocks)
                        new_pool.append({t for j in chosen for t in range(j * bs, min((j + 1) * bs, len(scores)))})
                    elif kind == "I" and attn.role.uses_pool:
                        scores = [s if t in pool[i] else -math.inf for t, s in enumerate(scores)]
                    new_topk.append(_top(scores, cfg.csa2_index_topk))
                topk = new_topk
                pool = new_pool if kind == "P" else pool
            heads, d = attn.heads, attn.head_dim
            w_out = attn.linear_o_group_proj.weight.view(cfg.csa2_output_groups, cfg.csa2_output_rank, -1)
            for i in range(SEQ):
                q = (attn.linear_q_up.weight @ q_lat[i]).view(heads, d)
                window = [keys[j] for j in range(max(0, i - cfg.csa2_sliding_window + 1), i + 1)]
                picked = [compressed[t] for t in topk[i]] if kind != "S" else []
                kv = torch.stack(window + picked)  # keys double as values
                o = []
                for hd in range(heads):
                    logits = kv @ rope(q[hd], i) / math.sqrt(d)
                    probs = torch.exp(logits) / (torch.exp(logits).sum() + torch.exp(attn.attn_sink[hd]))
                    o.append(rope(probs @ kv, i, inv=True))
                groups = torch.stack(o).view(cfg.csa2_output_groups, -1)
                z = torch.cat([w_out[g] @ groups[g] for g in range(cfg.csa2_output_groups)])
                y = attn.linear_proj.weight @ z
                p, post, comb = coeffs[i]
                streams[i] = post[:, None] * y + comb.t() @ streams[i]
                pre[i] = p
            for i in range(SEQ):
                p, post, comb = _coefficients(layer.mlp_hyper_connection, streams[i], cfg)
                m = _rms(pre[i] @ streams[i], layer.pre_mlp_layernorm.weight, eps)
                fc1, fc2 = layer.mlp.linear_fc1.weight, layer.mlp.linear_fc2.weight
                y = fc2 @ torch.nn.functional.gelu(fc1 @ m)
                streams[i] = post[:, None] * y + comb.t() @ streams[i]
                pre[i] = p
        for i in range(SEQ):
            out[i, b] = _rms(pre[i] @ streams[i], block.final_layernorm.weight, eps)
    return out


class TestCSA2Attention:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_block_matches_plain_computation(self):
        config = _config()
        block = TransformerBlock(config, get_csa2_decoder_block_spec(config)).cuda()
        kinds = [layer.self_attention.role.kind for layer in block.layers]
        assert kinds == list("SFPIR") and block.layers[3].self_attention.role.uses_pool
        assert block.layers[4].self_attention.indexer is None
        hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")
        out = block(hidden, attention_mask=None)
        with torch.no_grad():
            expected = _reference(block, hidden)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("method, num_layers", [("uniform", 2), ("block", 3)])
    def test_full_recompute_keeps_layer_state_gradients(self, method, num_layers):
        reference = TransformerBlock(_config(), get_csa2_decoder_block_spec(_config())).cuda()
        recompute = _config(
            recompute_granularity="full", recompute_method=method, recompute_num_layers=num_layers
        )
        block = TransformerBlock(recompute, get_csa2_decoder_block_spec(recompute)).cuda()
        block.load_state_dict(reference.state_dict())
        hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")
        grads = []
        for model in (reference, block):
            inputs = hidden.clone().requires_grad_(True)
            model(inputs, attention_mask=None).square().sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        # The F layer's compressor is read by the P/I/R layers: its gradient crosses chunk boundaries.
        gate = "layers.1.self_attention.compressor.linear_gate.weight"
        assert grads[0][gate].abs().sum() > 0
        for name, grad in grads[0].items():
            if grad is None:  # the indexer gets no language-model gradient
                assert grads[1][name] is None, name
                continue
            torch.testing.assert_close(grads[1][name], grad, msg=name)

    def test_outputs_are_causal(self):
        config = _config()
        block = TransformerBlock(config, get_csa2_decoder_block_spec(config)).cuda()
        hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")
        changed = hidden.clone()
        changed[7:] = torch.randn_like(changed[7:])
        torch.testing.assert_close(
            block(changed, attention_mask=None)[:7], block(hidden, attention_mask=None)[:7]
        )
