"""DSV41-VLLM-001: the V4.1 vision model supports LoRA, and vision adapters are isolated per image."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from tests.vllm import _vllm_helpers as vh
from tests.vllm._twins import stock

PATCH_ID = "DSV41-VLLM-001"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
ARCH = "DeepseekV41ForCausalLM"
RATIO = 3
IDS = (51, 52)


def _model_cls():
    from vllm.model_executor.models.registry import ModelRegistry

    return ModelRegistry.models[ARCH].load_model_cls()


def test_v41_vision_model_declares_lora(patch_form):
    from vllm.model_executor.models.interfaces import supports_lora, supports_multimodal

    cls = _model_cls()
    assert supports_lora(cls) and supports_multimodal(cls)
    model = cls.__new__(cls)
    model.config = types.SimpleNamespace(vision_downsample_ratio=RATIO)
    keys = cls.get_mm_mapping(model)
    counts = cls.get_mm_lora_token_counts(model, modality="image", num_mm_embeds=10,
                                          mm_kwargs={"vit_grid": types.SimpleNamespace(data=torch.tensor([6, 9]))})
    with pytest.raises(ValueError, match="audio"):
        cls.get_mm_lora_token_counts(model, modality="audio", mm_kwargs=None, num_mm_embeds=4)
    patch_form.record("mm_keys", [keys.language_model, keys.connector, keys.tower_model])
    patch_form.record("token_counts", list(counts))
    patch_form.record("packed", {k: list(v) for k, v in sorted(cls.packed_modules_mapping.items())})
    patch_form.record("skip", list(cls.lora_skip_prefixes))
    patch_form.record("tower_connector", bool(cls.supports_tower_connector_lora))
    assert counts == (54, 6)
    assert {"wqkv", "w1", "fused_wkv_wgate"} <= set(cls.packed_modules_mapping)


# ---- per-image adapter isolation ---------------------------------------------------------------------
class _Tower(nn.Module):
    """A one-linear ViT: patches [n, p] -> [n, dv] (a real vLLM ReplicatedLinear, LoRA-wrapped)."""

    def __init__(self, proj):
        super().__init__()
        self.proj = proj

    def forward(self, patches, n_vit_h, n_vit_w):
        return self.proj(patches)[0]


class _Aligner(nn.Module):
    """3×3 spatial merge then one linear `w1` (LoRA-wrapped): [n_vit, dv] -> [n_llm, D]."""

    def __init__(self, w1):
        super().__init__()
        self.w1 = w1

    def forward(self, x, n_vit_h, n_vit_w):
        dv = x.shape[-1]
        x = x.view(n_vit_h // RATIO, RATIO, n_vit_w // RATIO, RATIO, dv).permute(0, 2, 1, 3, 4)
        return self.w1(x.reshape(-1, RATIO * RATIO * dv))[0]


def _span_types(h, w):
    from vllm.models.deepseek_v41.common.mm_preprocess import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START

    return torch.tensor([IMAGE_START] + ([IMAGE] * w + [IMAGE_NEW_LINE]) * h + [IMAGE_END])


def _lora_linear(in_f, out_f, wrapper, seed):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    gen = torch.Generator().manual_seed(seed)
    base = ReplicatedLinear(in_f, out_f, bias=False, params_dtype=torch.float32)
    base.weight.data.copy_(torch.randn(out_f, in_f, generator=gen) * 0.1)
    base.quant_method.process_weights_after_loading(base)
    layer = vh.wrap(base, max_loras=2, rank=8)
    for slot in range(2):
        layer.set_lora(slot, torch.randn(4, in_f, generator=gen) * 0.3, torch.randn(out_f, 4, generator=gen) * 0.3)
    layer.set_mapping(wrapper)
    return layer


def _vision_model(cls, seed=7):
    """An instance of the registered class carrying a tiny LoRA'd tower/aligner and a LoRA manager view."""
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.model_executor.models.module_mapping import MultiModelKeys

    model = cls.__new__(cls)
    nn.Module.__init__(model)
    wrappers = {"language_model": vh.punica(), "vision.": vh.punica(), "aligner": vh.punica()}
    p, dv, d = 12, 8, 16
    model.vision = _Tower(_lora_linear(p, dv, wrappers["vision."], seed))
    model.aligner = _Aligner(_lora_linear(RATIO * RATIO * dv, d, wrappers["aligner"], seed + 1))
    gen = torch.Generator().manual_seed(seed + 2)
    for name in ("image_start", "image_end", "image_newline"):
        setattr(model, name, nn.Parameter(torch.randn(d, generator=gen)))
    model.config = types.SimpleNamespace(vision_downsample_ratio=RATIO)
    model.use_data_parallel = False
    manager = types.SimpleNamespace(
        mm_mapping=MultiModelKeys(language_model=["language_model"], connector=["aligner"], tower_model=["vision."]),
        punica_wrapper_mapping=wrappers, supports_mm=True, supports_tower_connector_lora=True,
        supported_modules_to_save=set(), _classification_head=None, lora_index_to_id=list(IDS), lora_slots=2,
        vocab_size=512, _last_mapping=None)
    manager._get_punica_wrapper = types.MethodType(LoRAModelManager._get_punica_wrapper, manager)
    manager.install = types.MethodType(LoRAModelManager._set_adapter_mapping, manager)
    model.lora_manager = manager
    return model


def _step(cls, model, images, lora_ids):
    """One runner step: install TOWER/CONNECTOR mappings for all images (runner order), then encode them."""
    from vllm.lora.layers import LoRAMapping, LoRAMappingType

    tower, connector = [], []
    for (n_h, n_w), lid in zip([g for g, _ in images], lora_ids):
        tower += [lid] * (n_h * n_w)
        connector += [lid] * ((n_h // RATIO) * (n_w // RATIO))
    mgr = model.lora_manager
    mgr.install(LoRAMapping(tuple(tower), tuple(lora_ids), is_prefill=True, type=LoRAMappingType.TOWER))
    mgr.install(LoRAMapping(tuple(connector), tuple(lora_ids), is_prefill=True, type=LoRAMappingType.CONNECTOR))
    grids = [g for g, _ in images]
    image_input = types.SimpleNamespace(
        patches=torch.cat([x for _, x in images]), vit_grid=torch.tensor(grids),
        llm_grid=torch.tensor([(h // RATIO, w // RATIO) for h, w in grids]),
        types=torch.cat([_span_types(h // RATIO, w // RATIO) for h, w in grids]))
    return cls._process_image_input(model, image_input)


def _images(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [((6, 9), torch.randn(54, 12, generator=gen)), ((3, 3), torch.randn(9, 12, generator=gen)),
            ((6, 6), torch.randn(36, 12, generator=gen))]


def test_two_requests_with_different_adapters_never_mix(patch_form, vllm_cpu):
    """Three images of two requests (adapters 51, 52, 51) in one step == each image encoded alone."""
    cls = _model_cls()
    model = _vision_model(cls)
    images = _images()
    lora_ids = [IDS[0], IDS[1], IDS[0]]
    batched = _step(cls, model, images, lora_ids)
    alone = [_step(cls, model, [img], [lid])[0] for img, lid in zip(images, lora_ids)]
    for i, (got, want) in enumerate(zip(batched, alone)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"image {i}")
    # and the adapters do differ: image 1 under the other adapter is a different embedding
    other = _step(cls, model, [images[1]], [IDS[0]])[0]
    assert not torch.allclose(other, alone[1], atol=1e-4)
    patch_form.record("spans", [t for t in batched], atol=1e-6)


def test_mapping_disagreeing_with_the_images_is_an_error(patch_form, vllm_cpu):
    """If the step mapping does not line up with the encoded images, refuse instead of mixing adapters."""
    from vllm.lora.layers import LoRAMapping, LoRAMappingType

    cls = _model_cls()
    model = _vision_model(cls)
    images = _images()[:2]
    model.lora_manager.install(LoRAMapping((IDS[0],) * 10, (IDS[0],), is_prefill=True, type=LoRAMappingType.TOWER))
    model.lora_manager.install(LoRAMapping((IDS[0],) * 7, (IDS[0], IDS[1]), is_prefill=True,
                                           type=LoRAMappingType.CONNECTOR))
    image_input = types.SimpleNamespace(
        patches=torch.cat([x for _, x in images]), vit_grid=torch.tensor([g for g, _ in images]),
        llm_grid=torch.tensor([(2, 3), (1, 1)]), types=torch.cat([_span_types(2, 3), _span_types(1, 1)]))
    with pytest.raises(RuntimeError, match="refusing|covers") as err:
        cls._process_image_input(model, image_input)
    patch_form.record("refused", "adapter" in str(err.value) or "covers" in str(err.value))


def test_stock_vllm_cannot_encode_per_image_adapters(vllm_cpu):
    """The bug the patch fixes, on vLLM 0.33's own class: every image reads the step mapping from row 0.

    On GPU the Triton kernels take the first rows of the mapping (image 2 runs with image 1's adapter); the
    CPU punica kernels detect the row-count mismatch and fail. Either way the stock class cannot serve it.
    """
    with stock(PATCH_ID):
        cls = _model_cls()
        model = _vision_model(cls)
        images = _images()[:2]
        alone = _step(cls, model, [images[1]], [IDS[1]])[0]
        try:
            batched = _step(cls, model, images, [IDS[0], IDS[1]])
        except RuntimeError as exc:
            assert "size" in str(exc)  # sgmv: mapping rows != encoded rows
            return
    assert not torch.allclose(batched[1], alone, atol=1e-4)


def test_registered_class_is_lazy_and_reverts(vllm_cpu):
    from vllm.model_executor.models.registry import ModelRegistry

    with stock(PATCH_ID):
        stock_entry = ModelRegistry.models[ARCH]
        assert stock_entry.module_name == "vllm.models.deepseek_v41"
    from tests.vllm._twins import applied

    with applied(PATCH_ID):
        entry = ModelRegistry.models[ARCH]
        assert (entry.module_name, entry.class_name) == ("dsv4flash.integrations.vllm.model",
                                                          "DeepseekV41ForCausalLMWithLoRA")
