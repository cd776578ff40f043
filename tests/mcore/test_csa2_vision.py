"""The ViT + aligner inside `DSV41MegatronModel`: image spans from pixel inputs equal the reference model's
(logits and, when unfrozen, ViT/aligner gradients), frozen by default, first pipeline stage only, clear errors."""

from __future__ import annotations

import re

import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.whole_machine]


@pytest.fixture(scope="module")
def mcore():
    """One single-rank Megatron session for the module (gloo, CUDA redirect)."""
    with parallel.model_parallel(seed=1234), sup.single_thread():
        yield


def vl_batch(cfg, seed: int = 0):
    """Two prompts [2, S] with one image each (grids 4×5 and 3×3, different token grids) -> ids, types, images."""
    from dsv4flash.model.image import ImageInput, expand_image_placeholders, pad_prompts

    gen = torch.Generator().manual_seed(seed)
    p = cfg.vision.patch_size
    images = [ImageInput(torch.randn(h * w, 3 * p * p, generator=gen), (h, w)) for h, w in ((4, 5), (3, 3))]
    prompts = []
    for image, (before, after) in zip(images, ((5, 7), (3, 11))):
        prompt = torch.cat([torch.randint(3, 499, (before,), generator=gen), torch.tensor([cfg.image_token_id]),
                            torch.randint(3, 499, (after,), generator=gen)])
        prompts.append(expand_image_placeholders(prompt, [image], cfg))
    padded = pad_prompts(prompts, pad_token_id=0)
    return padded.input_ids, padded.token_types, images


def pixel_inputs(images):
    """The Megatron form: pixel_values [Σ n_h·n_w, 3·p·p] and image_grid_hw [n_images, 2]."""
    return torch.cat([img.patches for img in images]), torch.tensor([img.grid_hw for img in images])


def test_vit_and_aligner_are_megatron_modules_frozen_by_default(mcore):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    ref = sup.reference(seed=0)
    model = sup.megatron_from(ref)
    for module in (model.vision_model, model.vision_projection):  # megatron-bridge's upstream-form ViT, no copy
        assert type(module).__module__ == "megatron.bridge.models.deepseek_v41.deepseek_v41_vision"
    layer = model.vision_model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, ColumnParallelLinear)
    assert isinstance(layer.self_attention.linear_proj, RowParallelLinear)
    assert isinstance(model.vision_projection.encoder.linear_fc2, RowParallelLinear)
    vision = {n for n, _ in model.named_parameters() if n.startswith(("vision_model.", "vision_projection."))}
    assert len(vision) == 2 + 8 * ref.cfg.vision.num_hidden_layers + 1 + 4  # patch embed, blocks, norm, aligner
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == vision  # the delimiters and the whole text model still train
    with torch.no_grad():
        layer.input_layernorm.weight.add_(2.0 ** -20)  # not representable in bf16
    norm = layer.input_layernorm.weight.detach().clone()
    model.bfloat16()
    assert torch.equal(layer.input_layernorm.weight, norm)  # the release's fp32 norms survive a cast, value and dtype
    assert layer.self_attention.linear_qkv.weight.dtype == torch.bfloat16


def test_image_spans_from_pixels_equal_the_reference(mcore):
    ref = sup.reference(seed=0).eval()
    ids, types, images = vl_batch(ref.cfg)
    model = sup.megatron_from(ref).eval()
    pixel_values, grid = pixel_inputs(images)
    with torch.no_grad():
        want = ref(ids, types, images)
        got = model(ids, token_types=types, pixel_values=pixel_values, image_grid_hw=grid)
        text_only = model(ids, token_types=types, decoder_input=torch.zeros(ids.shape[1], 2, 64))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert (got - text_only).abs().max() > 1e-2  # the pixels really reach the logits


def test_unfrozen_vit_and_aligner_get_the_reference_gradients(mcore):
    from dsv4flash.integrations.mcore.csa2 import name_map
    from dsv4flash.integrations.mcore.csa2.weights import qkv_per_head

    ref = sup.reference(seed=0).train()
    ids, types, images = vl_batch(ref.cfg, seed=1)
    weights = sup.probe((*ids.shape, ref.cfg.text.vocab_size), seed=2)
    (ref(ids, types, images) * weights).sum().backward()
    model = sup.megatron_from(ref, freeze_vision_model=False, freeze_vision_projection=False)
    pixel_values, grid = pixel_inputs(images)
    (model(ids, token_types=types, pixel_values=pixel_values, image_grid_hw=grid) * weights).sum().backward()
    ref_params, params = dict(ref.named_parameters()), dict(model.named_parameters())
    checked = 0
    for pair in name_map(ref.cfg, ("vision",)):
        want = ref_params[pair.reference[0]].grad
        if pair.transform == "qkv":
            want = qkv_per_head(want, ref.cfg.vision.num_attention_heads)
        got = params[pair.megatron].grad
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 2e-4 * scale + 1e-7, pair.megatron
        checked += 1
    assert checked == len(name_map(ref.cfg, ("vision",))) and checked > 20


def test_pixel_inputs_are_checked(mcore):
    ref = sup.reference(seed=0)
    ids, types, images = vl_batch(ref.cfg)
    model = sup.megatron_from(ref).eval()
    pixel_values, grid = pixel_inputs(images)
    with pytest.raises(ValueError, match="neither pixel_values nor decoder_input"):
        model(ids, token_types=types)
    wrong = "pixel_values must be [29, 3*p*p] for image_grid_hw [[4, 5], [3, 3]], got [28, 588]"
    with pytest.raises(ValueError, match=re.escape(wrong)):
        model(ids, token_types=types, pixel_values=pixel_values[:-1], image_grid_hw=grid)
    with pytest.raises(ValueError, match="need token_types"):
        model(ids, pixel_values=pixel_values, image_grid_hw=grid)


def _tp_rank(rank: int, world_size: int, expected_path: str) -> None:
    """One TP rank: its shard of the ViT/aligner (heads, MLP and aligner split), pixels in, full logits out."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    ref = sup.reference(seed=0)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        model = DSV41ModelProvider(ref.cfg, parallel_output=False).provide()
        load_reference_state(model, ref.state_dict(), tp_rank=rank, tp_size=world_size)
        qkv = model.vision_model.decoder.layers[0].self_attention.linear_qkv.weight
        assert qkv.shape[0] == 3 * ref.cfg.vision.hidden_size // world_size  # this rank's heads only
        with torch.no_grad():
            out = model.eval()(expected["ids"], token_types=expected["types"], pixel_values=expected["pixels"],
                               image_grid_hw=expected["grid"])
        torch.testing.assert_close(out, expected["logits"], rtol=0, atol=2e-5)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_two_tensor_parallel_ranks_encode_images_like_the_reference(tmp_path):
    ref = sup.reference(seed=0).eval()
    ids, types, images = vl_batch(ref.cfg, seed=3)
    pixels, grid = pixel_inputs(images)
    with torch.no_grad(), sup.single_thread():
        logits = ref(ids, types, images)
    path = tmp_path / "expected.pt"
    torch.save({"ids": ids, "types": types, "pixels": pixels, "grid": grid, "logits": logits}, path)
    parallel.spawn_gloo(_tp_rank, 2, str(path))
