"""DSV41-MCORE-003: padding tokens keep their top-k dispatcher slots with probability 0 on balanced experts.

The stock tests show what 0.19.2 does with padding (routes it by its logits at full probability). The
`patch_form` tests run twice: with the runtime twin on the installed megatron-core, and in a subprocess on a
copy of the pinned release with the format-patch applied; both must pass and record identical values.
The option is switched on as an attribute of a built config, which both forms accept.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore_cpu import models

PATCH_ID = "DSV41-MCORE-003"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


def _config(zero_prob: bool = True, **overrides):
    config = models.tiny_moe_config(**overrides)
    config.moe_router_padding_zero_prob = zero_prob
    return config


def _router(config):
    """A real megatron-core TopKRouter on the current model-parallel state."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _padding(seq: int, batch: int) -> torch.Tensor:
    """[s, b], True = padding: the last three tokens of batch 1."""
    mask = torch.zeros(seq, batch, dtype=torch.bool)
    mask[-3:, 1] = True
    return mask


def _expert0_hidden(router, seq: int, batch: int) -> torch.Tensor:
    """Hidden states [s, b, h] whose logits favour expert 0 then 1 for every token (like a pad embedding)."""
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0], router.weight[1, 0] = 4.0, 2.0
    hidden = torch.zeros(seq, batch, router.config.hidden_size)
    hidden[..., 0] = 1.0
    return hidden


@pytest.fixture
def stock_upstream():
    """The installed megatron-core without this change (its Depends-On, the expert-bias count fix, applied)."""
    from dsv4flash.patching import twins

    registry = twins.discover()
    twin, dependency = registry.get(PATCH_ID), registry.get("DSV41-MCORE-001")
    if twin.upstream_has_it():
        pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
    outcome = dependency.apply()
    try:
        with twin.suspended():
            yield twin
    finally:
        if outcome is twins.Outcome.APPLIED:
            dependency.revert()


def test_stock_router_routes_padding_by_its_logits(mcore_parallel, stock_upstream):
    router = _router(_config())
    padding = _padding(6, 2)
    probs, routing_map = router(_expert0_hidden(router, 6, 2), padding_mask=padding)
    pad = padding.reshape(-1)
    assert torch.all(probs[pad].sum(-1) > 0.5)  # full probability on padding rows
    assert routing_map[pad][:, :2].all()  # every pad row on the same two experts


def test_padding_rows_get_zero_prob_on_balanced_experts(patch_form, mcore_parallel):
    router = _router(_config())
    padding = _padding(6, 2)
    probs, routing_map = router(_expert0_hidden(router, 6, 2), padding_mask=padding)  # [s*b, E]
    pad = padding.reshape(-1)
    assert torch.all(probs[pad] == 0)
    assert torch.all(routing_map.sum(-1) == router.topk)  # shapes stay fixed: k slots per token
    for t in torch.nonzero(pad).squeeze(-1).tolist():
        assert torch.nonzero(routing_map[t]).squeeze(-1).tolist() == sorted((t * 2 + j) % 4 for j in range(2))
    assert routing_map[~pad][:, :2].all()  # real tokens still follow their logits
    patch_form.record("probs", probs, atol=1e-6)
    patch_form.record("routing_map", routing_map)


def test_real_tokens_route_as_without_the_option(patch_form, mcore_parallel):
    torch.manual_seed(11)
    on, off = _router(_config()), _router(_config(zero_prob=False))
    off.load_state_dict(on.state_dict())
    hidden = torch.randn(6, 2, on.config.hidden_size)
    padding = _padding(6, 2)
    probs, routing_map = on(hidden, padding_mask=padding)
    ref_probs, ref_map = off(hidden, padding_mask=padding)
    real = ~padding.reshape(-1)
    torch.testing.assert_close(probs[real], ref_probs[real])
    assert torch.equal(routing_map[real], ref_map[real])
    patch_form.record("probs", probs, atol=1e-6)


@pytest.mark.parametrize("balancing", ["none", "aux_loss", "seq_aux_loss"])
def test_padding_adds_no_router_gradient_and_no_bias_counts(patch_form, mcore_parallel, balancing):
    torch.manual_seed(12)
    config = _config(moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    router = _router(config)
    hidden = torch.randn(6, 2, config.hidden_size, requires_grad=True)
    padding = _padding(6, 2)
    probs, routing_map = router(hidden, padding_mask=padding)
    probs.pow(2).sum().backward()
    assert torch.all(hidden.grad[-3:, 1] == 0)  # no gradient reaches padding tokens: probs, aux, z-loss
    assert hidden.grad[:, 0].abs().sum() > 0
    real = ~padding.reshape(-1)
    assert torch.equal(router.local_tokens_per_expert, routing_map[real].sum(0).float())
    patch_form.record("weight_grad", router.weight.grad, atol=1e-6, rtol=1e-5)
    patch_form.record("counts", router.local_tokens_per_expert)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_gpt_moe_padding_rows_add_no_expert_output(patch_form, mcore_parallel, dispatcher):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(13)
    model_parallel_cuda_manual_seed(13, force_reset_rng=True)
    model = models.tiny_gpt_moe(_config(moe_token_dispatcher_type=dispatcher))
    outputs = []
    hooks = [layer.mlp.register_forward_hook(lambda mod, inp, out: outputs.append(out[0].detach()))
             for layer in model.decoder.layers]
    padding = _padding(8, 2).T.contiguous()  # GPTModel takes [b, s]
    logits = model(**models.gpt_inputs(batch=2, seq_len=8), padding_mask=padding)  # [b, s, vocab]
    logits.float().pow(2).mean().backward()
    for hook in hooks:
        hook.remove()
    for out in outputs:  # MoELayer output [s, b, h]
        assert torch.all(out[-3:, 1] == 0) and out[:, 0].abs().sum() > 0
    grads = torch.stack([layer.mlp.router.weight.grad for layer in model.decoder.layers])
    patch_form.record("logits", logits, atol=1e-5, rtol=1e-5)
    patch_form.record("router_grads", grads, atol=1e-6, rtol=1e-5)
