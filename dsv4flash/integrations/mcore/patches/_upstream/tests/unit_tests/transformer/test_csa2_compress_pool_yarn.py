# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import math

import pytest
import torch

from megatron.core.models.gpt.csa2_layer_specs import (
    get_csa2_decoder_block_spec,
    get_csa2_layer_local_spec,
)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.experimental_attention_variant.csa2 import (
    CSA2TransformerConfig,
    rope_frequencies,
)
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from tests.unit_tests.test_utilities import Utils

SEQ, BATCH, HIDDEN = 12, 2, 32
# theta 10000, rope_dim 8, original context 64, beta 32 / 1: correction range [0, 2],
# ramp [0, .5, 1, 1]
YARN = dict(
    csa2_compressed_rope_theta=10000.0,
    csa2_yarn_factor=4.0,
    csa2_yarn_original_max_position_embeddings=64,
    csa2_yarn_beta_fast=32.0,
    csa2_yarn_beta_slow=1.0,
)


def _config(pattern="SCIR", ratios=(0, 1, 0, 0), **kwargs):
    options = dict(YARN)
    options.update(kwargs)
    return CSA2TransformerConfig(
        num_layers=len(pattern),
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
        csa2_layer_pattern=pattern,
        csa2_compress_ratios=list(ratios),
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
        **options,
    )


def _attention_layers(config):
    spec = get_csa2_layer_local_spec().submodules.self_attention
    return [
        build_module(spec, config=config, layer_number=n).cuda()
        for n in range(1, config.num_layers + 1)
    ]


# ---- a plain, per-token computation of the same attention ----------------------------------------
def _rms(x, weight, eps):
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, freqs, inverse=False):
    """Rotate the interleaved pairs of the last 2 * len(freqs) lanes of x [..., d] at pos."""
    out = x.clone()
    rope_dim, d = 2 * len(freqs), x.shape[-1]
    for p, f in enumerate(freqs.tolist()):
        angle = pos * f * (-1 if inverse else 1)
        c, s = math.cos(angle), math.sin(angle)
        a, b = x[..., d - rope_dim + 2 * p], x[..., d - rope_dim + 2 * p + 1]
        out[..., d - rope_dim + 2 * p] = a * c - b * s
        out[..., d - rope_dim + 2 * p + 1] = a * s + b * c
    return out


def _top(scores, k):
    """Indices of the k largest finite scores, ties to the lower index, sorted by index."""
    order = sorted(range(len(scores)), key=lambda t: (-scores[t], t))
    return sorted(t for t in order[:k] if scores[t] > -math.inf)


def _reference_layer(attn, x, state, freqs):
    """One CSA2 attention over x [s, b, h] with ratio 1, token by token; returns (out, state)."""
    cfg = attn.config
    eps, kind = cfg.layernorm_epsilon, attn.role.kind
    compressed, index_keys, topk, pool = state
    out = torch.empty_like(x)
    new_topk, new_pool, new_keys, new_index = [], [], [], []
    for b in range(x.shape[1]):
        h = [x[i, b] for i in range(SEQ)]
        q_lat = [_rms(attn.linear_q_down.weight @ v, attn.q_layernorm.weight, eps) for v in h]
        keys = [
            _rope(_rms(attn.linear_kv.weight @ v, attn.kv_layernorm.weight, eps), i, freqs)
            for i, v in enumerate(h)
        ]
        if kind == "C":  # ratio 1: one compressed key per token, no gate
            comp = attn.compressor
            latents = [_rms(comp.linear_kv.weight @ v, comp.norm.weight, eps) for v in h]
            idx = attn.indexer
            new_keys.append([_rope(v, t, freqs) for t, v in enumerate(latents)])
            new_index.append(
                [
                    _rope(_rms(idx.linear_k.weight @ v, idx.k_layernorm.weight, eps), t, freqs)
                    for t, v in enumerate(latents)
                ]
            )
        row_keys = new_keys[b] if kind == "C" else [compressed[b, t] for t in range(SEQ)]
        row_index = new_index[b] if kind == "C" else [index_keys[b, t] for t in range(SEQ)]
        row_topk, row_pool = [], []
        for i in range(SEQ):
            if kind in "CI":
                idx = attn.indexer
                q = (idx.linear_q.weight @ q_lat[i]).view(idx.heads, idx.head_dim)
                q = torch.stack([_rope(qh, i, freqs) for qh in q])
                w = idx.linear_weights.weight @ h[i] * idx.weight_scale
                scores = [
                    float((w * torch.relu(q @ row_index[t])).sum()) if t <= i else -math.inf
                    for t in range(SEQ)
                ]
                if kind == "C":
                    bs = cfg.csa2_candidate_block_size
                    best = [max(scores[j * bs : (j + 1) * bs]) for j in range(SEQ // bs)]
                    best[i // bs] = math.inf  # the newest visible block is always kept
                    chosen = _top(best, cfg.csa2_candidate_topk_blocks)
                    row_pool.append({t for j in chosen for t in range(j * bs, (j + 1) * bs)})
                else:
                    scores = [s if bool(pool[b, i, t]) else -math.inf for t, s in enumerate(scores)]
                row_topk.append(_top(scores, cfg.csa2_index_topk))
            else:
                row_topk.append([int(t) for t in topk[b, i] if t >= 0])
            q = (attn.linear_q_up.weight @ q_lat[i]).view(attn.heads, attn.head_dim)
            window = keys[max(0, i - cfg.csa2_sliding_window + 1) : i + 1]
            kv = torch.stack(window + [row_keys[t] for t in row_topk[i]])  # keys double as values
            o = []
            for hd in range(attn.heads):
                logits = kv @ _rope(q[hd], i, freqs) / math.sqrt(attn.head_dim)
                sink = torch.exp(attn.attn_sink[hd])
                probs = torch.exp(logits) / (torch.exp(logits).sum() + sink)
                o.append(_rope(probs @ kv, i, freqs, inverse=True))
            n_groups, rank = cfg.csa2_output_groups, cfg.csa2_output_rank
            groups = torch.stack(o).view(n_groups, -1)
            w_out = attn.linear_o_group_proj.weight.view(n_groups, rank, -1)
            z = torch.cat([w_out[g] @ groups[g] for g in range(n_groups)])
            out[i, b] = attn.linear_proj.weight @ z
        new_topk.append(row_topk)
        new_pool.append(row_pool)
    return out, new_keys, new_topk, new_pool


class TestCSA2CompressAndPoolYarn:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_yarn_interpolates_frequencies_only(self):
        plain = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
        ramp = torch.tensor([0.0, 0.5, 1.0, 1.0])
        expected = plain / 4.0 * ramp + plain * (1 - ramp)
        torch.testing.assert_close(rope_frequencies(8, 10000.0, 4.0, 64, 32.0, 1.0), expected)
        torch.testing.assert_close(rope_frequencies(8, 10000.0), plain)
        layers = _attention_layers(_config())
        positions = torch.arange(SEQ)
        # Window-only layers keep plain RoPE with their own base; compressed layers get YaRN.
        assert layers[0].yarn_factor == 1.0 and layers[1].yarn_factor == 4.0
        angles = layers[1].rotation(positions).angle()
        torch.testing.assert_close(angles[:, 1], positions * expected[1])

    def test_compress_and_pool_layer_matches_plain_computation(self):
        config = _config()
        _, compress_pool, reindex, reuse = _attention_layers(config)
        assert [a.role.kind for a in (compress_pool, reindex, reuse)] == list("CIR")
        assert compress_pool.compressor.linear_gate is None  # ratio 1: norm(linear_kv(x)), no gate
        assert compress_pool.indexer.linear_k is not None and reindex.indexer.linear_k is None
        assert reindex.role.uses_pool
        freqs = rope_frequencies(8, 10000.0, 4.0, 64, 32.0, 1.0)
        hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")
        out, state = compress_pool(hidden, ())
        with torch.no_grad():
            expected, keys, topk, pool = _reference_layer(compress_pool, hidden, (None,) * 4, freqs)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        compressed, index_keys, picked, candidates = state
        torch.testing.assert_close(compressed[0], torch.stack(keys[0]), atol=1e-5, rtol=1e-5)
        for b in range(BATCH):
            for i in range(SEQ):
                assert [int(t) for t in picked[b, i] if t >= 0] == topk[b][i], (b, i)
                assert {int(t) for t in candidates[b, i].nonzero()} == pool[b][i], (b, i)
        # The pool layer's own top-k is not restricted to its pool.
        outside = [
            (b, i) for b in range(BATCH) for i in range(SEQ) if not set(topk[b][i]) <= pool[b][i]
        ]
        assert outside, "the test input should give a top-k pick outside the candidate pool"
        for layer in (reindex, reuse):
            out, next_state = layer(hidden, state)
            with torch.no_grad():
                expected, _, topk, _ = _reference_layer(layer, hidden, state, freqs)
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
            for b in range(BATCH):
                for i in range(SEQ):
                    assert [int(t) for t in next_state[2][b, i] if t >= 0] == topk[b][i], (b, i)
                    if layer is reindex:
                        assert set(topk[b][i]) <= {int(t) for t in candidates[b, i].nonzero()}
            assert next_state[3] is candidates  # published once, read by later layers
            state = next_state

    def test_block_trains_the_pool_layer_compressor_and_is_causal(self):
        config = _config(pattern="SFRCIR", ratios=(0, 2, 0, 1, 0, 0))
        block = TransformerBlock(config, get_csa2_decoder_block_spec(config)).cuda()
        assert [layer.self_attention.role.kind for layer in block.layers] == list("SFRCIR")
        assert block.layers[4].self_attention.role.uses_pool
        hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")
        out = block(hidden, attention_mask=None)
        out.square().sum().backward()
        kv = block.layers[3].self_attention.compressor.linear_kv.weight
        assert kv.grad is not None and kv.grad.abs().sum() > 0
        changed = hidden.clone()
        changed[7:] = torch.randn_like(changed[7:])
        with torch.no_grad():
            torch.testing.assert_close(
                block(changed, attention_mask=None)[:7], block(hidden, attention_mask=None)[:7]
            )

    @pytest.mark.parametrize(
        "options, message",
        [
            (dict(pattern="SIR", ratios=(0, 0, 0)), "need an F or C layer"),
            (dict(ratios=(0, 0, 0, 0)), "of C layer must be >= 1"),
            (dict(csa2_yarn_original_max_position_embeddings=0), "must be set"),
            (dict(csa2_yarn_factor=0.5), "must be >= 1"),
        ],
    )
    def test_config_refuses_bad_options(self, options, message):
        with pytest.raises(ValueError, match=message):
            _config(**options)
