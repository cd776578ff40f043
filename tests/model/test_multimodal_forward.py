"""The whole model with an image span: ViT → aligner → span fill, bias_vl routing and no Engram delta there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4flash.model.image import prepare_vl_inputs


def _prompt(cfg, seed=0):
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, size=(42, 84, 3), dtype=np.uint8)
    ids = torch.tensor([5, 6, 7, cfg.image_token_id, 8, 9, 10, 11])
    ids, types, images = prepare_vl_inputs(ids, [image], cfg, dtype=torch.float32)
    return ids[None], types[None], images


def test_image_span_feeds_the_language_model_and_trains_the_tower(tiny_model, tiny_cfg):
    ids, types, images = _prompt(tiny_cfg)
    assert ids.shape[1] == 7 + 5  # a 42×84 image is a 1×2 grid: 1·3 + 2 = 5 span tokens
    logits = tiny_model(ids, types, images)
    _, _, other = _prompt(tiny_cfg, seed=1)
    with torch.no_grad():
        swapped = tiny_model(ids, types, other)
    # text before the image is unaffected (up to BLAS last-ulp noise from different expert row counts)
    assert (swapped[:, :3] - logits.detach()[:, :3]).abs().max() < 1e-5
    assert (swapped[:, -1] - logits.detach()[:, -1]).abs().max() > 1e-4
    logits[:, -1].logsumexp(-1).sum().backward()
    for name in ("vision.patch_embed.proj.weight", "aligner.w1.weight", "image_start", "image_end",
                 "image_newline"):
        assert dict(tiny_model.named_parameters())[name].grad.abs().sum() > 0, name


def test_no_engram_delta_on_image_tokens_and_bias_vl_routes_them(tiny_model, tiny_cfg):
    ids, types, images = _prompt(tiny_cfg)
    image_rows = types[0] >= 0
    seen = {}
    engram = tiny_model.layers[1].engram
    engram.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], out=out))
    gate = tiny_model.layers[1].ffn.gate
    gate.register_forward_hook(lambda mod, args, out: seen.update(experts=out[1]))
    with torch.no_grad():
        gate.bias_vl[3] = 1e3
        gate.bias[3] = -1e3
        tiny_model(ids, types, images)
    assert torch.equal(seen["out"][0, image_rows], seen["x"][0, image_rows])
    assert not torch.equal(seen["out"][0, ~image_rows], seen["x"][0, ~image_rows])
    experts = seen["experts"]
    assert (experts[image_rows] == 3).any(-1).all() and not (experts[~image_rows] == 3).any()


def test_image_types_without_images_is_an_error(tiny_model, tiny_cfg):
    ids, types, _ = _prompt(tiny_cfg)
    with pytest.raises(ValueError, match="no images were given"):
        tiny_model(ids, types)
