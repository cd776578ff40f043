"""DSV41-VERL-012: veRL's Megatron engine forward (`gptmodel_forward_model_engine`, what `get_mcore_engine_forward_fn`
returns for V4.1) feeds the in-model ViT from veRL's `multi_modal_inputs`: a geometry prompt through the V4.1
processor (as veRL's agent loop builds the inputs) gives the reference model's logits, the image changes them,
and a processor output the model does not name is not passed. Stock veRL drops `token_types`/`image_grid_hw`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore_cpu import parallel
from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-012"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


@pytest.fixture(scope="module")
def mcore():
    """One single-rank Megatron session for the module (gloo, CUDA redirect)."""
    with parallel.model_parallel(seed=1234), sup.single_thread():
        yield


@pytest.fixture(scope="module")
def setup(mcore, tmp_path_factory):
    """The tiny reference, its Megatron twin (same weights), veRL's model config with the V4.1 processor."""
    from verl.workers.config import HFModelConfig

    from dsv4flash.engine.model_io import save_base
    from dsv4flash.hf.processing import save_processor_files
    from dsv4flash.tasks import TaskTokenizer
    from dsv4flash.tasks.hf_tokenizer import save_hf_tokenizer

    ref = sup.reference(seed=0).eval()
    root = tmp_path_factory.mktemp("mm_kwargs")
    base = save_base(ref, ref.cfg, TaskTokenizer(ref.cfg), root / "base", {"kind": "test"})
    tok_dir = save_processor_files(base, save_hf_tokenizer(TaskTokenizer(ref.cfg), root / "verl_tokenizer"))
    model_config = HFModelConfig(path=str(base), tokenizer_path=str(tok_dir))
    return ref, sup.megatron_from(ref).eval(), model_config


def _agent_loop_inputs(processor, seed: int):
    """(input_ids [1, S], multi_modal_inputs) of one geometry prompt, as veRL's agent loop computes them."""
    from dsv4flash.tasks import build_task

    ex = build_task("geometry").sample(np.random.default_rng(seed))
    out = dict(processor(text=[processor.tokenizer.bos_token + ex.prompt], images=list(ex.images),
                         return_tensors="pt"))
    ids = out.pop("input_ids")
    out.pop("attention_mask", None)
    return ids, out, ex


def _engine_forward(model, model_config, ids, multi_modal_inputs):
    """veRL's engine forward of one sample (micro-batch of 1, THD), logits [S, V]."""
    from verl.models.mcore import get_mcore_engine_forward_fn
    from verl.utils.model import extract_multi_modal_inputs

    forward_fn = get_mcore_engine_forward_fn(model_config.hf_config)
    nested = torch.nested.as_nested_tensor([ids[0]], layout=torch.jagged)
    with torch.no_grad():
        out = forward_fn(model, nested, extract_multi_modal_inputs([multi_modal_inputs]),
                         vision_model=hasattr(model_config.hf_config, "vision_config"),
                         pad_token_id=model_config.tokenizer.pad_token_id, data_format="thd")
    return out.unbind()[0] if out.is_nested else out[0]


def _received_keys(model):
    """A forward hook recording the keyword arguments the model was called with (after every pre-hook)."""
    seen: list[set[str]] = []
    handle = model.register_forward_hook(lambda _m, _a, kwargs, _o: seen.append(set(kwargs)), with_kwargs=True)
    return seen, handle


def test_the_vit_gets_verls_multimodal_inputs(patch_form, setup):
    ref, model, model_config = setup
    ids, mm, ex = _agent_loop_inputs(model_config.processor, seed=0)
    assert {"token_types", "pixel_values", "image_grid_hw"} <= set(mm)
    mm["images_seqlens"] = torch.tensor([int(mm["pixel_values"].shape[0])])  # a key no V4.1 forward names
    seen, handle = _received_keys(model)
    try:
        got = _engine_forward(model, model_config, ids, mm)
    finally:
        handle.remove()
    assert {"token_types", "pixel_values", "image_grid_hw"} <= seen[0] and "images_seqlens" not in seen[0]
    with torch.no_grad():
        want = ref(ids, mm["token_types"], [_image_input(mm)])[0]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    other = dict(mm, pixel_values=mm["pixel_values"].flip(0))  # same grid, other pixels
    changed = _engine_forward(model, model_config, ids, other)
    image_end = int((mm["token_types"][0] >= 0).nonzero().max())
    assert (changed[image_end:] - got[image_end:]).abs().max() > 1e-3  # the pixels reach the text rows after it
    patch_form.record("rows", list(got.shape))
    patch_form.record("logits", got[image_end:], atol=1e-5)


def _image_input(mm):
    from dsv4flash.model.image import ImageInput

    return ImageInput(mm["pixel_values"], tuple(int(v) for v in mm["image_grid_hw"][0]))


def test_stock_verl_drops_the_image_spans(setup):
    ref, model, model_config = setup
    ids, mm, _ = _agent_loop_inputs(model_config.processor, seed=1)
    with stock(PATCH_ID):
        with pytest.raises(ValueError, match="pixel_values need token_types marking the image spans"):
            _engine_forward(model, model_config, ids, mm)
