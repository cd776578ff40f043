"""DSV41-VERL-011: veRL's own `hf_processor` and `HFModelConfig` keep the V4.1 processor (1-D RoPE, nothing to
bind), loaded from the run's tokenizer directory as `dsv4flash.train.verl_engine` writes it; stock veRL drops it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-011"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from dsv4flash.config import load_config
    from dsv4flash.engine.model_io import save_base
    from dsv4flash.hf.processing import save_processor_files
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer
    from dsv4flash.tasks.hf_tokenizer import save_hf_tokenizer

    cfg = load_config("tiny")
    root = tmp_path_factory.mktemp("verl_processor")
    base = save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), root / "base", {"kind": "test"})
    tok_dir = save_processor_files(base, save_hf_tokenizer(TaskTokenizer(cfg), root / "verl_tokenizer"))
    return base, tok_dir


def test_hf_model_config_carries_the_v41_processor(patch_form, dirs):
    from verl.utils import hf_processor
    from verl.workers.config import HFModelConfig

    from dsv4flash.model.image import prepare_vl_inputs
    from dsv4flash.tasks import TaskTokenizer, build_task

    base, tok_dir = dirs
    model = HFModelConfig(path=str(base), tokenizer_path=str(tok_dir))
    proc = model.processor
    assert type(proc).__name__ == "DeepseekV41Processor" and type(proc.config).__name__ == "DeepseekV41Config"
    assert type(hf_processor(str(base))).__name__ == "DeepseekV41Processor"  # the base dir itself too
    ex = build_task("geometry").sample(np.random.default_rng(0))
    out = proc(text=[proc.tokenizer.bos_token + ex.prompt], images=list(ex.images))
    tok = TaskTokenizer(model.hf_config.to_dsv4flash())
    ids, _, images = prepare_vl_inputs([tok.bos_id] + tok.encode(ex.prompt), list(ex.images),
                                       model.hf_config.to_dsv4flash(), dtype=torch.float32)
    assert torch.equal(out["input_ids"][0], ids) and torch.equal(out["pixel_values"], images[0].patches)
    patch_form.record("processor", type(proc).__name__)
    patch_form.record("input_ids", out["input_ids"])
    patch_form.record("image_grid_hw", out["image_grid_hw"])


def test_an_unlisted_processor_of_an_mrope_model_is_still_refused():
    from types import SimpleNamespace

    from dsv4flash.integrations.verl.patches.processor_1d_rope import uses_multimodal_rope

    assert uses_multimodal_rope(SimpleNamespace(rope_scaling={"type": "default", "mrope_section": [16, 24, 24]}))
    assert uses_multimodal_rope(SimpleNamespace(text_config=SimpleNamespace(
        rope_parameters={"mrope_section": [24, 20, 20]})))
    assert not uses_multimodal_rope(SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 16.0}))


def test_stock_verl_drops_the_processor(dirs):
    base, _ = dirs
    with stock(PATCH_ID), pytest.warns(UserWarning, match="Unsupported processor type: DeepseekV41Processor"):
        # Looked up inside the block: a name bound while the twin was applied would still be the twin's.
        from verl.utils import hf_processor

        assert hf_processor(str(base)) is None
