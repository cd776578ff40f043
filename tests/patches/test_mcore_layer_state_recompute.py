"""DSV41-MCORE-007: an explicit per-layer state (a tuple in the context slot) through full recompute.

A real megatron-core TransformerBlock of four local-spec layers whose layers hand the next one a state
tuple and consume the previous one (so every layer's parameters get gradient through later layers). The
stock test shows 0.19.2's full recompute cannot carry it. The `patch_form` tests run with the runtime twin
on the installed megatron-core and on a copy of the pinned release with the format-patch applied: uniform
and block recompute must reproduce the no-recompute outputs and gradients, and both forms must agree.
"""

from __future__ import annotations

import copy

import pytest
import torch

PATCH_ID = "DSV41-MCORE-007"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]

SEQ, BATCH, HIDDEN = 8, 2, 32


def _stateful_layer_class():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class StatefulLayer(TransformerLayer):
        """Hands the next layer (carry [s, b, h], None) in the context slot; consumes the previous carry."""

        def forward(self, hidden_states, context=None, **kwargs):
            hidden, _ = super().forward(hidden_states, **kwargs)  # [s, b, h]
            previous = context[0] if isinstance(context, tuple) else torch.zeros_like(hidden)
            carry = previous + torch.tanh(hidden)
            return hidden + 0.5 * previous, (carry, None)

    return StatefulLayer


def _block(post_layer_norm: bool = True, **recompute):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, add_bias_linear=False, params_dtype=torch.float32,
                               use_cpu_initialization=True, **recompute)
    spec = copy.copy(get_gpt_layer_local_spec())
    spec.module = _stateful_layer_class()
    return TransformerBlock(config, spec, post_layer_norm=post_layer_norm)


def _run(block, hidden):
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    inputs = hidden.clone().requires_grad_(True)
    out = block(inputs, attention_mask=mask)  # [s, b, h]
    out.square().sum().backward()
    return out.detach(), inputs.grad, {n: p.grad for n, p in block.named_parameters()}


def test_stock_full_recompute_cannot_carry_a_state_tuple(mcore_parallel):
    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        block = _block(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        with pytest.raises(TypeError, match="save_for_backward can only save variables"):
            _run(block, torch.randn(SEQ, BATCH, HIDDEN))


@pytest.mark.parametrize("method, num_layers", [("uniform", 1), ("uniform", 3), ("block", 2)])
def test_full_recompute_keeps_state_gradients(mcore_parallel, patch_form, method, num_layers):
    torch.manual_seed(41)
    reference = _block()
    block = _block(recompute_granularity="full", recompute_method=method, recompute_num_layers=num_layers)
    block.load_state_dict(reference.state_dict())
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    ref_out, ref_input_grad, ref_grads = _run(reference, hidden)
    out, input_grad, grads = _run(block, hidden)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(input_grad, ref_input_grad)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=name)
    first = "layers.0.mlp.linear_fc1.weight"
    assert grads[first].abs().sum() > 0  # the first layer is trained through every later layer's state
    patch_form.record("output", out, atol=1e-5, rtol=1e-5)
    patch_form.record("first_layer_grad", grads[first], atol=1e-5, rtol=1e-5)


def _hybrid(**recompute):
    """A megatron-core HybridStack of four attention ('*') layers built from the same stateful layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, add_bias_linear=False, params_dtype=torch.float32,
                               use_cpu_initialization=True, **recompute)
    spec = copy.copy(get_gpt_layer_local_spec())
    spec.module = _stateful_layer_class()
    # No final norm: HybridStack's is a Transformer Engine norm.
    return HybridStack(config, HybridStackSubmodules(attention_layer=spec), layer_type_list=["*"] * 4,
                       post_layer_norm=False, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


@pytest.mark.parametrize("recompute", [False, True])
def test_hybrid_stack_carries_the_state_like_the_block(mcore_parallel, patch_form, recompute):
    torch.manual_seed(42)
    reference = _block(post_layer_norm=False)
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2) if recompute else {}
    hybrid = _hybrid(**extra)
    for ours, theirs in zip(hybrid.layers, reference.layers):
        ours.load_state_dict(theirs.state_dict())
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    ref_out, ref_input_grad, _ = _run(reference, hidden)
    out, input_grad, grads = _run(hybrid, hidden)
    torch.testing.assert_close(out, ref_out)  # layer i + 1 saw layer i's carry, as in TransformerBlock
    torch.testing.assert_close(input_grad, ref_input_grad)
    patch_form.record("output", out, atol=1e-5, rtol=1e-5)
    patch_form.record("first_layer_grad", grads["layers.0.mlp.linear_fc1.weight"], atol=1e-5, rtol=1e-5)


def test_stock_hybrid_stack_drops_the_state(mcore_parallel):
    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        torch.manual_seed(43)
        reference, hybrid = _block(post_layer_norm=False), _hybrid()
        for ours, theirs in zip(hybrid.layers, reference.layers):
            ours.load_state_dict(theirs.state_dict())
        hidden = torch.randn(SEQ, BATCH, HIDDEN)
        assert not torch.allclose(_run(hybrid, hidden)[0], _run(reference, hidden)[0])
