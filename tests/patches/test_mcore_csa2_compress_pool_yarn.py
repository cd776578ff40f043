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


WITHOUT_THE_PATCH = """
import torch
from megatron.core.transformer.experimental_attention_variant.csa2 import CSA2TransformerConfig
base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, kv_channels=16, ffn_hidden_size=64,
            normalization="RMSNorm", add_bias_linear=False, hc_mult=2, csa2_rope_dim=8, csa2_output_groups=2,
            csa2_index_head_dim=8, csa2_compress_ratios=[0, 1, 0, 0])
for options in (dict(csa2_layer_pattern="SCIR"), dict(csa2_layer_pattern="SFIR", csa2_yarn_factor=4.0)):
    try:
        CSA2TransformerConfig(**base, **options)
    except (ValueError, TypeError) as exc:
        print(type(exc).__name__, str(exc).splitlines()[0])
"""


def test_csa2_without_the_patch_has_no_pool_layer_that_compresses_and_no_yarn():
    tree = patched_tree("DSV41-MCORE-008")
    assert "DSV41-MCORE-011" not in tree.patch_ids
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.sys_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", WITHOUT_THE_PATCH], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ValueError csa2_layer_pattern must have one of 'SFPIR'"), lines
    assert lines[1].startswith("TypeError") and "csa2_yarn_factor" in lines[1], lines


@pytest.mark.parametrize("method, num_layers", [("uniform", 2), ("block", 4)])
def test_full_recompute_carries_the_pool_of_a_compress_and_pool_layer(patch_form, mcore_parallel, method,
                                                                      num_layers):
    torch.manual_seed(112)
    reference = _block()
    block = _block(recompute_granularity="full", recompute_method=method, recompute_num_layers=num_layers)
    block.load_state_dict(reference.state_dict())
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    out_ref, grad_ref, grads_ref = _run(reference, hidden)
    out, grad_in, grads = _run(block, hidden)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(grad_in, grad_ref)
    for name, grad in grads_ref.items():
        if grad is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], grad, msg=name)
    patch_form.record("output", out, atol=1e-5, rtol=1e-5)


def test_block_with_a_compress_and_pool_layer(patch_form, mcore_parallel):
    torch.manual_seed(111)
    block = _block()
    assert [layer.self_attention.role.kind for layer in block.layers] == list("SFRCIR")
    out, grad_in, grads = _run(block, torch.randn(SEQ, BATCH, HIDDEN))
    assert grads["layers.3.self_attention.compressor.linear_kv.weight"].abs().sum() > 0
    assert "layers.3.self_attention.compressor.linear_gate.weight" not in grads  # ratio 1: no gate
    patch_form.record("output", out, atol=1e-5, rtol=1e-5)
    patch_form.record("input_grad", grad_in, atol=1e-5, rtol=1e-5)


# ---- parity with the reference model on the tiny config (release layer plan) ----------------------------
TINY = "tiny"  # the packaged tiny config, dsv4flash/data/tiny_config.json (docs/architecture.md §14)
KIND_OF_MODE = {"swa": "S", "full": "F", "reindex": "I", "reuse": "R"}
# reference `attn.*` -> CSA2SelfAttention (docs/patches.md, DSV41-MBRIDGE-001 name map)
NAMES = {"wq_a": "linear_q_down", "q_norm": "q_layernorm", "wq_b": "linear_q_up", "wkv": "linear_kv",
         "kv_norm": "kv_layernorm", "wo_a": "linear_o_group_proj", "wo_b": "linear_proj", "attn_sink": "attn_sink",
         "compressor.wkv": "compressor.linear_kv", "compressor.wgate": "compressor.linear_gate",
         "compressor.norm": "compressor.norm", "indexer.wq_b": "indexer.linear_q",
         "indexer.weights_proj": "indexer.linear_weights", "indexer.wk": "indexer.linear_k",
         "indexer.k_norm": "indexer.k_layernorm"}


def release_pattern(plan) -> str:
    """csa2_layer_pattern of a V4.1 layer plan: kv sources F (C when also the candidate source), index-only
    sources I, the rest R, window-only layers S."""
    return "".join("C" if p.is_candidate_source else KIND_OF_MODE[p.mode] for p in plan)


def tiny_csa2_config(cfg):
    """A CSA2TransformerConfig with the tiny config's attention (release plan, its YaRN values)."""
    from megatron.core.transformer.experimental_attention_variant.csa2 import CSA2TransformerConfig

    t = cfg.text
    return CSA2TransformerConfig(
        num_layers=t.num_hidden_layers, hidden_size=t.hidden_size, num_attention_heads=t.num_attention_heads,
        kv_channels=t.head_dim, ffn_hidden_size=t.moe_intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=t.rms_norm_eps, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, use_cpu_initialization=True, hc_mult=t.hc_mult,
        csa2_layer_pattern=release_pattern(cfg.backbone_plan), csa2_compress_ratios=list(t.compress_ratios),
        csa2_q_lora_rank=t.q_lora_rank, csa2_rope_dim=t.qk_rope_head_dim, csa2_rope_theta=float(t.rope_theta),
        csa2_compressed_rope_theta=float(t.compress_rope_theta), csa2_sliding_window=t.sliding_window,
        csa2_output_groups=t.o_groups, csa2_output_rank=t.o_lora_rank, csa2_index_heads=t.index_n_heads,
        csa2_index_head_dim=t.index_head_dim, csa2_index_topk=t.index_topk,
        csa2_candidate_block_size=t.candidate_block_size, csa2_candidate_topk_blocks=t.candidate_topk_blocks,
        csa2_yarn_factor=float(t.rope_scaling.factor),
        csa2_yarn_original_max_position_embeddings=t.rope_scaling.original_max_position_embeddings,
        csa2_yarn_beta_fast=float(t.rope_scaling.beta_fast), csa2_yarn_beta_slow=float(t.rope_scaling.beta_slow))


def _picks(topk):
    """[b, s, k] top-k with -1 for unused -> the sorted picks of each query."""
    return [[sorted(int(t) for t in row if t >= 0) for row in batch] for batch in topk]


@pytest.mark.parametrize("seq", [64, 63])
def test_release_layer_plan_matches_the_reference_attention(patch_form, mcore_parallel, monkeypatch, seq):
    import dsv4flash.model.attention as ref_attention
    import dsv4flash.model.indexer as ref_indexer
    from dsv4flash.config import load_config
    from dsv4flash.model.attention import Attention
    from dsv4flash.model.state import CSA2State
    from megatron.core.models.gpt.csa2_layer_specs import get_csa2_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    # Upstream CSA2 has no fake-quant points (DSV41-MCORE-008): compare with the reference's exact math.
    for module, name in ((ref_attention, "fake_quant_window_kv"), (ref_attention, "fake_quant_compressed_kv"),
                         (ref_indexer, "fake_quant_index")):
        monkeypatch.setattr(module, name, lambda x: x)
    cfg = load_config(TINY)
    config = tiny_csa2_config(cfg)
    assert config.csa2_layer_pattern == "SSFRFRCRIRIR"
    spec = get_csa2_layer_local_spec().submodules.self_attention
    torch.manual_seed(121)
    reference = [Attention(cfg.text, plan, torch.float32, "cpu") for plan in cfg.backbone_plan]
    layers = [build_module(spec, config=config, layer_number=n + 1) for n in range(len(reference))]
    for ref, layer in zip(reference, layers):
        params = dict(layer.named_parameters())
        assert len(params) == len(list(ref.parameters())), layer.role  # every release weight has a home
        for name, p in ref.named_parameters():
            with torch.no_grad():
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0.0))
                params[NAMES[name[:-7]] + ".weight" if name.endswith(".weight") else NAMES[name]].copy_(p)
    assert layers[6].compressor.linear_gate is None and layers[2].compressor.linear_gate is not None
    ref_state, state = CSA2State(), ()
    outputs = []
    with torch.no_grad():
        for n, (ref, layer) in enumerate(zip(reference, layers)):
            x = torch.randn(2, seq, cfg.text.hidden_size)
            expected, ref_state = ref(x, ref_state)
            out, state = layer(x.transpose(0, 1), state)
            torch.testing.assert_close(out.transpose(0, 1), expected, atol=2e-5, rtol=2e-5, msg=f"layer {n}")
            if layer.role.kind != "S":
                torch.testing.assert_close(state[0], ref_state.compress_kv, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(state[1], ref_state.index_k, atol=1e-5, rtol=1e-5)
                assert _picks(state[2]) == _picks(ref_state.topk), f"layer {n} top-k"
            if n >= 6:  # the C layer and every layer after it carry its pool
                assert torch.equal(state[3], ref_state.candidates), f"layer {n} candidates"
            outputs.append(out)
    patch_form.record("outputs", torch.stack(outputs), atol=1e-5, rtol=1e-5)
