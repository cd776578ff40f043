"""DSV41-VERL-014: veRL's agent loop computes V4.1's token-aligned multimodal inputs on the trajectory's own ids.

`AgentLoopWorker._compute_multi_modal_inputs` (veRL's, on a worker without its Ray servers) for a sampled
geometry trajectory (expanded prompt + response) returns `token_types` aligned row for row with the ids the
actor trains on, equal to the reference preparation, and the image's pixels; stock veRL's decode round trip
loses the `<image>` placeholder and refuses the image.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.verl.test_r3_rollout_rows import _worker
from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-014"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


@pytest.fixture(scope="module")
def trajectory(tmp_path_factory):
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.workers.config import HFModelConfig

    from dsv4flash.config import load_config
    from dsv4flash.engine.model_io import save_base
    from dsv4flash.hf.processing import save_processor_files
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer, build_task
    from dsv4flash.tasks.hf_tokenizer import save_hf_tokenizer

    cfg = load_config("tiny")
    root = tmp_path_factory.mktemp("token_aligned")
    base = save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), root / "base", {"kind": "test"})
    tok_dir = save_processor_files(base, save_hf_tokenizer(TaskTokenizer(cfg), root / "verl_tokenizer"))
    model_config = HFModelConfig(path=str(base), tokenizer_path=str(tok_dir))
    proc = model_config.processor
    ex = build_task("geometry").sample(np.random.default_rng(4))
    prompt = proc(text=[proc.tokenizer.bos_token + ex.prompt], images=list(ex.images), return_tensors="pt")
    response = proc.tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [proc.tokenizer.eos_token_id]
    out = AgentLoopOutput(prompt_ids=prompt["input_ids"][0].tolist(), response_ids=response,
                          response_mask=[1] * len(response), multi_modal_data={"images": list(ex.images)},
                          metrics=AgentLoopMetrics())
    return cfg, model_config, out, prompt, ex


def _padded_ids(out) -> torch.Tensor:
    """[1, P + R] left-padded prompt + right-padded response, as `_agent_loop_postprocess` passes them."""
    return torch.tensor([[0] * 3 + list(out.prompt_ids) + list(out.response_ids) + [0] * 2])


def test_token_types_follow_the_trajectory_ids(patch_form, trajectory):
    from dsv4flash.model.image import prepare_vl_inputs
    from dsv4flash.tasks import TaskTokenizer

    cfg, model_config, out, prompt, ex = trajectory
    mm = _worker(model_config)._compute_multi_modal_inputs(out, _padded_ids(out))
    types = mm["token_types"][0]
    assert types.numel() == len(out.prompt_ids) + len(out.response_ids)
    tok = TaskTokenizer(cfg)
    _, want, images = prepare_vl_inputs([tok.bos_id] + tok.encode(ex.prompt), list(ex.images), cfg,
                                        dtype=torch.float32)
    assert torch.equal(types[:len(out.prompt_ids)], want) and bool((types[len(out.prompt_ids):] == -1).all())
    assert torch.equal(mm["pixel_values"], images[0].patches) and mm["image_grid_hw"].tolist() == [
        list(images[0].grid_hw)]
    patch_form.record("token_types", types)


def test_stock_verl_loses_the_image_placeholder(trajectory):
    _, model_config, out, _, _ = trajectory
    with stock(PATCH_ID), pytest.raises(ValueError, match="1 images given but the text has 0 <image> placeholders"):
        _worker(model_config)._compute_multi_modal_inputs(out, _padded_ids(out))


def test_a_text_trajectory_and_a_missing_token_types_input(trajectory):
    """Text prompts (the arithmetic recipe) get all-text token_types and an identity row map; image tokens
    without token_types are refused rather than replayed row for row."""
    _, model_config, out, _, _ = trajectory
    proc = model_config.processor
    ids = [proc.tokenizer.bos_token_id, *out.response_ids]
    types = proc.token_aligned_inputs(ids)["token_types"]
    assert types.tolist() == [[-1] * len(ids)]
    row_map, native = proc.routing_replay_rows(ids, len(ids) - 1, {"token_types": types})
    assert row_map.tolist() == list(range(len(ids) - 1)) and not bool(native.any())
    with pytest.raises(ValueError, match="has image tokens but multi_modal_inputs has no token_types"):
        proc.routing_replay_rows(list(out.prompt_ids), len(out.prompt_ids) - 1, {})
