"""Geometry image prompts through veRL's own data path: `RLHFDataset` rows (as `dsv4flash.tasks.verl_export`
writes them) with the V4.1 processor from veRL's `HFModelConfig` (DSV41-VERL-011), images extracted by
`ImagePromptDataset` (veRL's `data.custom_cls`) and tokenized by veRL's own multimodal Continuous Token builder:
prompt ids, token types and pixels equal the reference preparation of the same example."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dsv4flash.config import load_config
    from dsv4flash.engine.model_io import save_base
    from dsv4flash.hf.processing import save_processor_files
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskMixture, TaskTokenizer, build_task
    from dsv4flash.tasks.hf_tokenizer import save_hf_tokenizer
    from dsv4flash.tasks.verl_export import export_parquet

    cfg = load_config("tiny")
    root = tmp_path_factory.mktemp("image_prompts")
    base = save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), root / "base", {"kind": "test"})
    tok_dir = save_processor_files(base, save_hf_tokenizer(TaskTokenizer(cfg), root / "tok"))
    mixture = TaskMixture({"geometry": build_task("geometry")}, {"geometry": 1.0}, 0, 2)
    files = export_parquet(mixture, root / "data", train_size=3)
    return cfg, base, tok_dir, files, mixture


def test_rows_tokenize_to_the_reference_image_prompts(setup):
    from omegaconf import OmegaConf
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
    from verl.workers.config import HFModelConfig

    from dsv4flash.integrations.verl.dataset import ImagePromptDataset
    from dsv4flash.model.image import prepare_vl_inputs
    from dsv4flash.tasks import TaskTokenizer

    cfg, base, tok_dir, files, mixture = setup
    model = HFModelConfig(path=str(base), tokenizer_path=str(tok_dir))
    data_cfg = OmegaConf.create({"prompt_key": "prompt", "image_key": "images", "max_prompt_length": 64,
                                 "filter_overlong_prompts": False, "return_raw_chat": True})
    dataset = ImagePromptDataset(data_files=[str(files["train"])], tokenizer=model.tokenizer,
                                 processor=model.processor, config=data_cfg)
    builder = create_continuous_token_builder(model.tokenizer, hf_model_type=model.hf_config.model_type,
                                              processor=model.processor)
    assert builder.supports_multimodal()
    tok = TaskTokenizer(cfg)
    examples = [ex for _, ex in mixture.train_batch(0, 3)]
    assert len(dataset) == len(examples)
    for i, ex in enumerate(examples):
        messages = dataset[i]["raw_prompt"]
        images, videos, _ = asyncio.run(ImagePromptDataset.process_multi_modal_info(
            messages, image_patch_size=model.processor.image_processor.patch_size, config=data_cfg))
        assert videos is None and [np.asarray(img).tolist() for img in images] == [im.tolist() for im in ex.images]
        mm: dict = {}
        prompt_ids = builder.build_initial_tokens(messages, images=images, mm_inputs_out=mm)
        ids, types, ref = prepare_vl_inputs([tok.bos_id] + tok.encode(ex.prompt), list(ex.images), cfg,
                                            dtype=torch.float32)
        assert prompt_ids == ids.tolist()
        assert torch.equal(mm["token_types"][0], types)
        assert torch.equal(mm["pixel_values"], torch.cat([r.patches for r in ref]))
        assert mm["image_grid_hw"].tolist() == [list(r.grid_hw) for r in ref]


def test_video_parts_are_refused_by_name():
    from dsv4flash.integrations.verl.dataset import ImagePromptDataset

    with pytest.raises(ValueError, match="video parts are not supported"):
        ImagePromptDataset._process_multi_modal_info(
            [{"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}], 14, None)
