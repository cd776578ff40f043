"""DSV41-MCORE-010: manifold-constrained hyper-connections (mHC) as a megatron-core layer with a ModuleSpec.

The stock test shows 0.19.2 has no such module. The `patch_form` tests run with the runtime twin (which
executes the patch's own files, byte-identical under `dsv4flash/integrations/mcore/patches/_upstream/`) on the
installed megatron-core and on a copy of the pinned release with the patch applied: a real `TransformerBlock`
of megatron-core's stock self-attention and MLP on three streams must be causal, keep its coefficients doubly
stochastic, train the coefficient parameters, reproduce its gradients under uniform and block recompute (the
collapse weights cross chunk boundaries in the context slot, DSV41-MCORE-007), and agree between the forms.
The in-patch unit test (a per-token computation written in the test) runs in test_upstream_unit_tests.py.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

PATCH_ID = "DSV41-MCORE-010"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]

ROOT = Path(__file__).resolve().parents[2]
SEQ, BATCH, HIDDEN = 8, 2, 32


def added_files(patch_id: str) -> dict[str, str]:
    """The files a megatron-lm format-patch creates: repository path -> content."""
    from dsv4flash.patchseries.series import load_series

    patch = load_series(ROOT / "patches")["megatron-lm"].by_id()[patch_id]
    added = {}
    for rel in patch.files:
        if f"--- /dev/null\n+++ b/{rel}" in patch.diff:
            hunk = patch.diff.split(f"+++ b/{rel}\n", 1)[1].split("\ndiff --git", 1)[0]
            added[rel] = "".join(line[1:] + "\n" for line in hunk.splitlines()[1:] if line.startswith("+"))
    return added


def _block(**kwargs):
    from megatron.core.models.gpt.hyper_connection_layer_specs import get_hyper_connection_layer_local_spec
    from megatron.core.transformer.hyper_connection import HyperConnectionTransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = HyperConnectionTransformerConfig(
        num_layers=3, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2, params_dtype=torch.float32,
        use_cpu_initialization=True, hc_mult=3, hc_sinkhorn_iters=5, **kwargs)
    return TransformerBlock(config, get_hyper_connection_layer_local_spec())


def _run(block, hidden):
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    inputs = hidden.clone().requires_grad_(True)
    out = block(inputs, attention_mask=mask)  # [s, b, h]
    out.square().sum().backward()
    return out.detach(), inputs.grad, {n: p.grad for n, p in block.named_parameters()}


def test_stock_release_has_no_hyper_connection_layer():
    from dsv4flash.patching import twins
    from dsv4flash.integrations.mcore.patches.hyper_connection_layer import MODULES

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        for name in MODULES:
            with pytest.raises(ImportError):
                importlib.import_module(name)


def test_twin_runs_the_patch_files_byte_for_byte():
    from dsv4flash.integrations.mcore.patches import UPSTREAM_SOURCES
    from dsv4flash.integrations.mcore.patches.hyper_connection_layer import MODULES

    added = added_files(PATCH_ID)
    assert set(MODULES.values()) <= set(added)
    for rel, body in added.items():
        assert body == (UPSTREAM_SOURCES / rel).read_text(), f"{rel}: the twin's copy differs from the patch"


def test_streams_are_causal_and_coefficients_doubly_stochastic(patch_form, mcore_parallel):
    torch.manual_seed(101)
    block = _block()
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    out, grad_in, grads = _run(block, hidden)
    assert out.shape == (SEQ, BATCH, HIDDEN)
    changed = hidden.clone()
    changed[5:] = torch.randn_like(changed[5:])
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        torch.testing.assert_close(block(changed, attention_mask=mask)[:5], out[:5])
        streams = torch.randn(SEQ, BATCH, 3, HIDDEN)
        pre, post, comb = block.layers[1].mlp_hyper_connection(streams)
    assert bool((pre > 0).all() and (post > 0).all() and (post < 2).all())
    torch.testing.assert_close(comb.sum(-2), torch.ones(SEQ, BATCH, 3), atol=1e-4, rtol=0)  # columns exactly
    torch.testing.assert_close(comb.sum(-1), torch.ones(SEQ, BATCH, 3), atol=0.1, rtol=0)  # rows: close after 5 iters
    for name in ("layers.0.self_attn_hyper_connection.fn", "layers.2.mlp_hyper_connection.base"):
        assert grads[name].abs().sum() > 0, name
    patch_form.record("output", out, atol=1e-5, rtol=1e-5)
    patch_form.record("input_grad", grad_in, atol=1e-5, rtol=1e-5)
    patch_form.record("comb", comb, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("method, num_layers", [("uniform", 1), ("uniform", 2), ("block", 2)])
def test_full_recompute_matches_no_recompute(patch_form, mcore_parallel, method, num_layers):
    torch.manual_seed(102)
    reference = _block()
    block = _block(recompute_granularity="full", recompute_method=method, recompute_num_layers=num_layers)
    block.load_state_dict(reference.state_dict())
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    out_ref, grad_ref, grads_ref = _run(reference, hidden)
    out, grad_in, grads = _run(block, hidden)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(grad_in, grad_ref)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    patch_form.record("grad_norms", {n: float(g.norm()) for n, g in grads.items()}, atol=1e-4, rtol=1e-4)
