"""DSV41-MCORE-011: CSA2 layer kind `C` (compresses keys like `F` and publishes the candidate pool like `P`;
its own top-k is not restricted to the pool) and YaRN frequency interpolation on the layers that read
compressed keys (`csa2_yarn_factor`, `csa2_yarn_original_max_position_embeddings`, `csa2_yarn_beta_fast`,
`csa2_yarn_beta_slow`).

The stock test shows DSV41-MCORE-008 alone refuses the pattern and the fields. `_upstream/` holds the CSA2
files as the patched tree of 011 leaves them (checked byte for byte); the `patch_form` tests run on the twin
(008's twin executes those files) and on a copy of the pinned release with the patch applied.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.patches.test_mcore_hyper_connection import added_files

PATCH_ID = "DSV41-MCORE-011"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

ROOT = Path(__file__).resolve().parents[2]
SEQ, BATCH, HIDDEN = 12, 2, 32
YARN = dict(csa2_compressed_rope_theta=10000.0, csa2_yarn_factor=4.0, csa2_yarn_original_max_position_embeddings=64,
            csa2_yarn_beta_fast=32.0, csa2_yarn_beta_slow=1.0)


def patched_tree(*patch_ids: str):
    """The pinned megatron-core with these patches (and their Depends-On) applied."""
    from dsv4flash.patchseries import copies, fetch
    from dsv4flash.patchseries.series import load_series

    series = load_series(ROOT / "patches")["megatron-lm"]
    return copies.patched_copy(series, patch_ids, fetch.FetchOptions(source=os.environ.get(
        "DSV4FLASH_PATCH_SOURCE", "auto")))


def _block(pattern="SFRCIR", ratios=(0, 2, 0, 1, 0, 0), **kwargs):
    from megatron.core.models.gpt.csa2_layer_specs import get_csa2_decoder_block_spec
    from megatron.core.transformer.experimental_attention_variant.csa2 import CSA2TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    options = {**YARN, **kwargs}
    config = CSA2TransformerConfig(
        num_layers=len(pattern), hidden_size=HIDDEN, num_attention_heads=4, kv_channels=16, ffn_hidden_size=64,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.2, params_dtype=torch.float32, use_cpu_initialization=True, hc_mult=2,
        csa2_layer_pattern=pattern, csa2_compress_ratios=list(ratios), csa2_q_lora_rank=16, csa2_rope_dim=8,
        csa2_sliding_window=4, csa2_output_groups=2, csa2_output_rank=8, csa2_index_heads=2,
        csa2_index_head_dim=8, csa2_index_topk=3, csa2_candidate_block_size=2, csa2_candidate_topk_blocks=2,
        **options)
    return TransformerBlock(config, get_csa2_decoder_block_spec(config))


def _run(block, hidden):
    inputs = hidden.clone().requires_grad_(True)
    out = block(inputs, attention_mask=None)  # [s, b, h]
    out.square().sum().backward()
    return out.detach(), inputs.grad, {n: p.grad for n, p in block.named_parameters()}


def test_shipped_files_are_the_patched_tree_byte_for_byte():
    from dsv4flash.integrations.mcore.patches import UPSTREAM_SOURCES

    tree = patched_tree(PATCH_ID)
    changed = {f for f in added_files(PATCH_ID)} | {"megatron/core/transformer/experimental_attention_variant/csa2.py"}
    for rel in changed:
        assert (UPSTREAM_SOURCES / rel).read_text() == (tree.root / rel).read_text(), f"{rel}: _upstream/ differs"


def test_block_with_a_compress_and_pool_layer(patch_form, mcore_parallel):
    torch.manual_seed(111)
    block = _block()
    assert [layer.self_attention.role.kind for layer in block.layers] == list("SFRCIR")
    out, grad_in, grads = _run(block, torch.randn(SEQ, BATCH, HIDDEN))
    assert grads["layers.3.self_attention.compressor.linear_kv.weight"].abs().sum() > 0
    assert "layers.3.self_attention.compressor.linear_gate.weight" not in grads  # ratio 1: no gate
    patch_form.record("output", out, atol=1e-5, rtol=1e-5)
    patch_form.record("input_grad", grad_in, atol=1e-5, rtol=1e-5)
