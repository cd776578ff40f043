"""DSV41-MCORE-008: CSA2 attention (compressor, indexer, candidate pool, sink, grouped low-rank output) and the
mHC layer as new megatron-core modules with ModuleSpecs.

The stock test shows 0.19.2 has none of the modules. The twin executes the patch's own files (shipped under
`dsv4flash/integrations/mcore/patches/_upstream/`), and a test checks they are byte-identical to what the
format-patch adds. The `patch_form` tests run with the twin on the installed megatron-core and on a copy of
the pinned release with the patch applied: a real `TransformerBlock` built from `get_csa2_decoder_block_spec`
must be causal, reproduce its gradients under uniform and block recompute, train the F layer's compressor
from the later layers that read its keys (also with a MoE MLP), and agree between the forms. The in-patch unit test (a per-token
computation written in the test) runs on the patched tree in tests/patches/test_upstream_unit_tests.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.patches.test_mcore_hyper_connection import added_files

PATCH_ID = "DSV41-MCORE-008"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]

SEQ, BATCH, HIDDEN = 12, 2, 32


def _config(**kwargs):
    from megatron.core.transformer.experimental_attention_variant.csa2 import CSA2TransformerConfig

    return CSA2TransformerConfig(
        num_layers=5, hidden_size=HIDDEN, num_attention_heads=4, kv_channels=16, ffn_hidden_size=64,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.2, params_dtype=torch.float32, use_cpu_initialization=True, hc_mult=2,
        csa2_layer_pattern="SFPIR", csa2_compress_ratios=[0, 2, 0, 0, 0], csa2_q_lora_rank=16, csa2_rope_dim=8,
        csa2_sliding_window=4, csa2_output_groups=2, csa2_output_rank=8, csa2_index_heads=2,
        csa2_index_head_dim=8, csa2_index_topk=3, csa2_candidate_block_size=2, csa2_candidate_topk_blocks=2,
        **kwargs)


def _block(**kwargs):
    from megatron.core.models.gpt.csa2_layer_specs import get_csa2_decoder_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = _config(**kwargs)
    return TransformerBlock(config, get_csa2_decoder_block_spec(config))


def _run(block, hidden):
    inputs = hidden.clone().requires_grad_(True)
    out = block(inputs, attention_mask=None)  # [s, b, h]
    out.square().sum().backward()
    return out.detach(), inputs.grad, {n: p.grad for n, p in block.named_parameters()}


def test_stock_release_has_no_csa2_modules():
    from dsv4flash.patching import twins
    from dsv4flash.integrations.mcore.patches.csa2_attention import MODULES

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        for name in MODULES:
            with pytest.raises(ImportError):
                importlib.import_module(name)


def test_twin_runs_the_patch_files_byte_for_byte():
    from dsv4flash.integrations.mcore.patches import UPSTREAM_SOURCES
    from dsv4flash.integrations.mcore.patches.csa2_attention import MODULES, SHIPPED_AS_OF
    from tests.patches.test_mcore_csa2_compress_pool_yarn import patched_tree

    added = added_files(PATCH_ID)
    assert set(MODULES.values()) <= set(added)
    tree = patched_tree(SHIPPED_AS_OF)  # this patch's files as the later CSA2 patch that edits them leaves them
    for rel in added:
        shipped = (UPSTREAM_SOURCES / rel).read_text()
        assert shipped == (tree.root / rel).read_text(), f"{rel}: the twin's copy differs from the patched tree"
    # Without kind C and with csa2_yarn_factor 1.0 the shipped csa2.py is DSV41-MCORE-008: the patch_form tests
    # below build such blocks and compare them with the tree of this patch alone.


def test_block_is_causal_and_trains_the_compressor_from_later_layers(patch_form, mcore_parallel):
    torch.manual_seed(81)
    block = _block()
    assert [layer.self_attention.role.kind for layer in block.layers] == list("SFPIR")
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    out, grad_in, grads = _run(block, hidden)
    changed = hidden.clone()
    changed[7:] = torch.randn_like(changed[7:])
    with torch.no_grad():
        torch.testing.assert_close(block(changed, attention_mask=None)[:7], out[:7])
    gate = "layers.1.self_attention.compressor.linear_gate.weight"
    assert grads[gate].abs().sum() > 0
    # Only the compressed keys the later layers read connect layer 1's compressor to the loss beyond layer 1.
    last = block.layers[4].self_attention
    assert last.indexer is None and last.compressor is None
    assert all(grads[n] is None for n in grads if ".indexer." in n)  # discrete selection: no LM gradient
    patch_form.record("output", out, atol=1e-5, rtol=1e-5)
    patch_form.record("input_grad", grad_in, atol=1e-5, rtol=1e-5)
    patch_form.record("compressor_gate_grad", grads[gate], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method, num_layers", [("uniform", 2), ("block", 3)])
def test_full_recompute_matches_no_recompute(patch_form, mcore_parallel, method, num_layers):
    torch.manual_seed(82)
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
    patch_form.record("grad_norms", {n: float(g.norm()) for n, g in grads.items() if g is not None}, atol=1e-4,
                      rtol=1e-4)


def test_moe_mlp_in_the_csa2_layer(patch_form, mcore_parallel):
    torch.manual_seed(83)
    block = _block(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                   moe_token_dispatcher_type="alltoall")
    assert type(block.layers[0].mlp).__name__ == "MoELayer"
    out, grad_in, grads = _run(block, torch.randn(SEQ, BATCH, HIDDEN))
    assert bool(torch.isfinite(out).all())
    assert grads["layers.2.mlp.router.weight"].abs().sum() > 0  # routed through the mHC-collapsed input
    assert grads["layers.1.self_attention.compressor.linear_gate.weight"].abs().sum() > 0
    patch_form.record("output", out, atol=1e-5, rtol=1e-5)
