"""DSV41-MCORE-012: the MoE modality mask passed from GPTModel through the block and layers to the router.

The stock test shows 0.19.2's GPTModel takes no modality mask; the probe test shows the twin's
probe tells stock, patched and half-patched megatron-core apart by behaviour. The `patch_form` tests run twice: with the
runtime twin on the installed megatron-core, and in a subprocess on a copy of the pinned release with the
format-patch (and its Depends-On) applied; both must pass and record identical values. The selection is
checked against the reference router `dsv4flash.model.moe.Gate` (image tokens pick with `bias_vl`).
"""

from __future__ import annotations

from types import SimpleNamespace

import megatron.core  # noqa: F401  (ci/install.sh test installs it: a missing one must fail, not skip)
import pytest
import torch

from tests.mcore_cpu import models

PATCH_ID = "DSV41-MCORE-012"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]

BATCH, SEQ = 2, 8
RECOMPUTE = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective-moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}


def _model(modality_bias: bool = True, **overrides):
    """A 3-layer MoE GPTModel whose routers hold distinct random text and modality biases."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(12)
    model_parallel_cuda_manual_seed(12, force_reset_rng=True)
    config = models.tiny_moe_config(num_layers=3, **overrides)
    config.moe_router_modality_expert_bias = modality_bias
    config.moe_router_freeze_expert_bias = False
    config.moe_router_padding_zero_prob = False
    model = models.tiny_gpt_moe(config)
    if not modality_bias:
        return model
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.router.expert_bias.copy_(torch.randn(4, generator=gen))
            layer.mlp.router.modality_expert_bias.expert_bias.copy_(torch.randn(4, generator=gen))
    return model


def _image_mask() -> torch.Tensor:
    """[b, s], True = image token (a span in each row)."""
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    mask[0, 2:6] = True
    mask[1, 5:] = True
    return mask


def _reference_gate(router) -> torch.nn.Module:
    """The reference V4.1 router with this router's weight, `bias` and `bias_vl` (sqrtsoftplus, top-2)."""
    from dsv4flash.model.moe import Gate

    text = SimpleNamespace(routed_scaling_factor=1.0, norm_topk_prob=True, hidden_size=router.weight.shape[1])
    gate = Gate(text, router.weight.shape[0], router.topk, True, torch.float32, "cpu")
    with torch.no_grad():
        gate.weight.copy_(router.weight)
        gate.bias.copy_(router.expert_bias)
        gate.bias_vl.copy_(router.modality_expert_bias.expert_bias)
    return gate


def test_stock_gpt_model_takes_no_modality_mask(mcore_parallel):
    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        model = _model(modality_bias=False)  # the router twin (DSV41-MCORE-004) may be off here too
        with pytest.raises(TypeError, match="modality_mask"):
            model(**models.gpt_inputs(BATCH, SEQ), modality_mask=_image_mask())


def test_probe_needs_the_mask_to_reach_the_moe_layer(monkeypatch):
    """The probe runs upstream's forwards on 3 tokens: stock, or the layer half of the change alone, is "no fix"."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from dsv4flash.patching import twins
    from dsv4flash.integrations.mcore.patches.modality_mask import upstream_threads_modality_mask

    registry = twins.discover()
    twin = registry.get(PATCH_ID)
    active_before = {t.meta.patch_id for t in registry.all() if t.applied}
    with twin.suspended():
        stock = {name: TransformerLayer.__dict__[name] for name in ("forward", "_forward_mlp")}
        assert upstream_threads_modality_mask() is False
    try:
        assert twin.apply(mode="on", registry=registry).active
        assert upstream_threads_modality_mask() is True
        for name, value in stock.items():  # GPTModel and the block thread the mask, the layer drops it
            monkeypatch.setattr(TransformerLayer, name, value)
        assert upstream_threads_modality_mask() is False
    finally:
        monkeypatch.undo()
        for other in reversed(registry.all()):
            if other.applied and other.meta.patch_id not in active_before:
                other.revert()


def test_image_tokens_route_with_the_modality_bias(patch_form, mcore_parallel):
    model = _model()
    seen = []
    for layer in model.decoder.layers:
        layer.mlp.router.register_forward_hook(
            lambda module, args, out: seen.append((module, args[0].detach(), *(t.detach() for t in out))))
    image = _image_mask()
    logits = model(**models.gpt_inputs(BATCH, SEQ), modality_mask=image)
    rows = image.T.reshape(-1)  # the router's [s, b] token order
    assert len(seen) == 3
    differs = 0
    for router, hidden, probs, routing_map in seen:
        gate = _reference_gate(router)
        tokens = hidden.reshape(-1, hidden.shape[-1])
        weights, ids = gate(tokens, rows)
        expected = torch.zeros_like(routing_map).scatter(1, ids, True)
        assert torch.equal(routing_map, expected)
        torch.testing.assert_close(probs.gather(1, ids), weights, atol=1e-6, rtol=1e-6)
        _, text_ids = gate(tokens, None)
        assert torch.equal(text_ids[~rows], ids[~rows])  # text tokens: the text bias
        differs += int((text_ids[rows].sort(1).values != ids[rows].sort(1).values).any(1).sum())
        patch_form.record(f"routing_map{router.layer_number}", routing_map)
    assert differs > 0, "the modality bias changed no image token's selection: the check would be vacuous"
    patch_form.record("logits", logits, atol=1e-5, rtol=1e-5)


def test_no_mask_is_stock_bit_for_bit(patch_form, mcore_parallel):
    from dsv4flash.patching import twins

    model = _model()
    inputs = models.gpt_inputs(BATCH, SEQ)
    plain = model(**inputs)
    unmarked = model(**inputs, modality_mask=torch.zeros(BATCH, SEQ, dtype=torch.bool))
    assert torch.equal(plain, unmarked)  # an all-text mask selects with the text bias everywhere
    if patch_form.name == "runtime":
        with twins.discover().get(PATCH_ID).suspended():
            assert torch.equal(model(**inputs), plain)  # stock megatron-core computes the same logits
    patch_form.record("logits", plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("recompute", list(RECOMPUTE), ids=list(RECOMPUTE))
def test_recompute_routes_like_the_forward(patch_form, mcore_parallel, recompute):
    reference, model = _model(), _model(**RECOMPUTE[recompute])
    model.load_state_dict(reference.state_dict())
    image = _image_mask()
    inputs = models.gpt_inputs(BATCH, SEQ)
    observed = []
    for m in (reference, model):
        m(**inputs, modality_mask=image).float().pow(2).mean().backward()
        observed.append(({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None},
                         [layer.mlp.router.modality_expert_bias.local_tokens_per_expert.clone()
                          for layer in m.decoder.layers]))
    (grads, counts), (grads_r, counts_r) = observed
    assert sorted(grads) == sorted(grads_r)
    for name in grads:
        torch.testing.assert_close(grads_r[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
    for a, b in zip(counts, counts_r):  # counted once, in the recompute: image tokens only, top-2 each
        assert torch.equal(a, b) and int(a.sum()) == 2 * int(image.sum())
    patch_form.record("grads", torch.cat([grads_r[n].reshape(-1) for n in sorted(grads_r)]), atol=1e-6, rtol=1e-5)


def test_mask_shape_is_checked(patch_form, mcore_parallel):
    model = _model()
    with pytest.raises(ValueError, match=r"modality_mask must be \[bsz, seq_length\] like input_ids \(2, 8\)"):
        model(**models.gpt_inputs(BATCH, SEQ), modality_mask=_image_mask()[:, :-1])
    patch_form.record("refused", True)
