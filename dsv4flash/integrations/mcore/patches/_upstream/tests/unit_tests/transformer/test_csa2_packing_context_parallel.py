# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import pytest
import torch

from megatron.core.models.gpt.csa2_layer_specs import get_csa2_decoder_block_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.experimental_attention_variant.csa2 import CSA2TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlock
from tests.unit_tests.test_utilities import Utils

HIDDEN = 32


def _block(**kwargs):
    config = CSA2TransformerConfig(
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
        csa2_sliding_window=3,
        csa2_output_groups=2,
        csa2_output_rank=8,
        csa2_index_heads=2,
        csa2_index_head_dim=8,
        csa2_index_topk=2,
        csa2_candidate_block_size=2,
        csa2_candidate_topk_blocks=1,
        **kwargs,
    )
    return TransformerBlock(config, get_csa2_decoder_block_spec(config)).cuda()


def _packed(lengths, padded):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu.cuda(),
        cu_seqlens_kv=cu.cuda(),
        cu_seqlens_q_padded=cu_padded.cuda(),
        cu_seqlens_kv_padded=cu_padded.cuda(),
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )


class TestCSA2Packing:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_packed_sequences_match_separate_runs(self):
        block = _block()
        lengths, padded = [5, 8, 3], [6, 8, 4]
        starts = [0, 6, 14]
        hidden = torch.randn(sum(padded), 1, HIDDEN, device="cuda", requires_grad=True)
        out = block(hidden, attention_mask=None, packed_seq_params=_packed(lengths, padded))
        real = torch.cat([out[s : s + n] for s, n in zip(starts, lengths)])
        real.square().sum().backward()
        packed_grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
        block.zero_grad()
        for start, n in zip(starts, lengths):
            alone = block(hidden.detach()[start : start + n], attention_mask=None)
            torch.testing.assert_close(out[start : start + n], alone, atol=1e-5, rtol=1e-5)
            alone.square().sum().backward()
        for name, grad in packed_grads.items():
            separate = dict(block.named_parameters())[name].grad
            torch.testing.assert_close(grad, separate, atol=1e-4, rtol=1e-4, msg=name)


class TestCSA2ContextParallel:
    def setup_method(self, method):
        if Utils.world_size < 2:
            pytest.skip("needs at least two context-parallel ranks")
        Utils.initialize_model_parallel(1, 1, context_parallel_size=2)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_zigzag_shards_match_the_whole_sequence(self):
        from megatron.core import parallel_state

        cp, rank = 2, parallel_state.get_context_parallel_rank()
        reference = _block()
        block = _block(context_parallel_size=cp)
        block.load_state_dict(reference.state_dict())
        torch.manual_seed(5)
        hidden = torch.randn(16, 2, HIDDEN, device="cuda")
        full = reference(hidden, attention_mask=None)

        def mine(t):  # the zigzag split of get_batch_on_this_cp_rank
            return torch.cat([t.chunk(2 * cp)[rank], t.chunk(2 * cp)[2 * cp - 1 - rank]])

        out = block(mine(hidden), attention_mask=None)
        expected = mine(full)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


class TestCSA2Layouts:
    def test_contiguous_and_zigzag_spans(self):
        from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import (
            cp_spans,
            span_positions,
        )

        assert span_positions(cp_spans(2, [0, 8], "zigzag")[0]).tolist() == [0, 1, 6, 7]
        assert span_positions(cp_spans(2, [0, 8], "contiguous")[1]).tolist() == [4, 5, 6, 7]
        with pytest.raises(ValueError, match="unknown context-parallel split"):
            cp_spans(2, [0, 8], "ring")

    def test_right_padded_rows(self):
        from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import (
            build_csa2_layout,
        )

        padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
        layout = build_csa2_layout(2, 6, "cpu", 0, padding_mask=padding)
        assert layout.seq[1].tolist() == [0, 0, 0, 0, -1, -1] and layout.lengths == [[6], [4]]
        assert layout.groups(2).q_count[1].tolist() == [2, 2, 2, 2, 0, 0]
        with pytest.raises(ValueError, match="suffix"):
            build_csa2_layout(1, 4, "cpu", 0, padding_mask=torch.tensor([[True, False, False, False]]))
