"""DSV41-MCORE-004: a per-modality expert bias (`bias_vl`) and a freeze switch on megatron-core's router.

The stock test shows 0.19.2 has no modality channel. The `patch_form` tests run twice: with the runtime twin
on the installed megatron-core, and in a subprocess on a copy of the pinned release with the format-patch
applied; both must pass and record identical values. Options are set as attributes of a built config,
which both forms accept.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore_cpu import models

PATCH_ID = "DSV41-MCORE-004"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


def _config(frozen: bool = False, **overrides):
    config = models.tiny_moe_config(**overrides)
    config.moe_router_modality_expert_bias = True
    config.moe_router_freeze_expert_bias = frozen
    config.moe_router_padding_zero_prob = False
    return config


def _router(config):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _image_mask(seq: int, batch: int) -> torch.Tensor:
    """[s, b], True = image token: the first half of batch 1."""
    mask = torch.zeros(seq, batch, dtype=torch.bool)
    mask[: seq // 2, 1] = True
    return mask


def test_stock_router_has_no_modality_channel(mcore_parallel):
    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        router = _router(_config())
        assert not hasattr(router, "modality_expert_bias")
        with pytest.raises(TypeError, match="modality_mask"):
            router(torch.randn(4, 2, router.config.hidden_size), modality_mask=_image_mask(4, 2))


def test_each_modality_selects_and_counts_with_its_own_bias(patch_form, mcore_parallel):
    router = _router(_config(moe_router_topk=1))
    with torch.no_grad():
        router.weight.zero_()  # equal scores: the selection bias alone decides
        router.expert_bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))
        router.modality_expert_bias.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    image = _image_mask(6, 2)
    probs, routing_map = router(torch.randn(6, 2, router.config.hidden_size), modality_mask=image)
    rows = image.reshape(-1)
    assert routing_map[rows][:, 3].all() and routing_map[~rows][:, 0].all()
    assert router.local_tokens_per_expert.tolist() == [9.0, 0.0, 0.0, 0.0]
    assert router.modality_expert_bias.local_tokens_per_expert.tolist() == [0.0, 0.0, 0.0, 3.0]
    assert sorted(router.state_dict()) == ["expert_bias", "modality_expert_bias.expert_bias", "weight"]
    patch_form.record("routing_map", routing_map)
    patch_form.record("probs", probs, atol=1e-6)


@pytest.mark.parametrize("frozen", [False, True])
def test_finalize_updates_both_biases_unless_frozen(patch_form, mcore_parallel, frozen):
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    torch.manual_seed(21)
    config = _config(frozen=frozen, moe_router_bias_update_rate=1e-2)
    router = _router(config)
    assert router.frozen_expert_bias is frozen and router.modality_expert_bias.frozen_expert_bias is frozen
    image = _image_mask(8, 2)
    _, routing_map = router(torch.randn(8, 2, config.hidden_size), modality_mask=image)
    rows = image.reshape(-1)
    text_counts, image_counts = routing_map[~rows].sum(0).float(), routing_map[rows].sum(0).float()
    assert torch.equal(router.local_tokens_per_expert, text_counts)
    assert torch.equal(router.modality_expert_bias.local_tokens_per_expert, image_counts)
    _update_router_expert_bias([router], config)
    for bias, counts in ((router.expert_bias, text_counts),
                         (router.modality_expert_bias.expert_bias, image_counts)):
        step = torch.sign(counts.mean() - counts) * config.moe_router_bias_update_rate
        torch.testing.assert_close(bias, torch.zeros(4) if frozen else step)
    patch_form.record("biases", torch.stack([router.expert_bias, router.modality_expert_bias.expert_bias]),
                      atol=1e-9)


@pytest.mark.parametrize("recompute", [False, True])
def test_moe_layer_routes_image_tokens_with_the_modality_bias(patch_form, mcore_parallel, recompute):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(22)
    model_parallel_cuda_manual_seed(22, force_reset_rng=True)
    extra = dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}
    config = _config(**extra)
    layer = models.tiny_gpt_moe(config).decoder.layers[0].mlp  # a real MoELayer
    assert layer.moe_layer_recompute is recompute
    with torch.no_grad():
        layer.router.modality_expert_bias.expert_bias.copy_(torch.tensor([0.0, 0.0, 3.0, 3.0]))
    maps = []
    layer.router.register_forward_hook(lambda mod, inp, out: maps.append(out[1].detach()))
    hidden = torch.randn(6, 2, config.hidden_size, requires_grad=True)  # [s, b, h]
    image = _image_mask(6, 2).T.contiguous()  # MoELayer takes [b, s] like padding_mask
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, -1] = True
    output, _ = layer(hidden, padding_mask=padding, modality_mask=image)
    output.pow(2).sum().backward()
    rows = image.T.reshape(-1)
    assert maps[0][rows][:, 2:].all()  # image tokens pick the experts their bias favours
    assert len(maps) == (2 if recompute else 1) and torch.equal(maps[-1], maps[0])  # recompute routes alike
    real = ~padding.T.reshape(-1)
    assert torch.equal(layer.router.modality_expert_bias.local_tokens_per_expert, maps[0][rows & real].sum(0).float())
    assert torch.equal(layer.router.local_tokens_per_expert, maps[0][~rows & real].sum(0).float())
    patch_form.record("output", output, atol=1e-5, rtol=1e-5)
    patch_form.record("input_grad", hidden.grad, atol=1e-5, rtol=1e-5)
    patch_form.record("counts", torch.stack([layer.router.local_tokens_per_expert,
                                             layer.router.modality_expert_bias.local_tokens_per_expert]))
