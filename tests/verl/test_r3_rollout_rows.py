"""DSV41-VERL-013: veRL's agent loop joins the rollout's compact routes with the expanded prompt ids.

A geometry image prompt goes through veRL's own `AgentLoopWorker._agent_loop_postprocess` (padding, routes,
multimodal inputs recomputed by the V4.1 processor), `_postprocess` (the batch) and the trainer's
`left_right_2_no_padding`, with the routes a rollout records (the reference model's gates on the expanded
sequence, handed back compact as the rollout server does). veRL's text-only R3 alignment (DSV41-VERL-004) with
the batch's `r3_row_map` / `r3_native_rows` then puts, on every replayed text row, exactly the experts the
reference picks there natively; image rows are native. The in-run check (`replay_check.count_mismatches`)
is 0 on that, and catches a wrong mapping (stock veRL's row-for-row placement).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-013"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
PROMPT_LENGTH, RESPONSE_LENGTH = 160, 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from verl.workers.config import HFModelConfig

    from dsv4flash.engine.model_io import save_base
    from dsv4flash.hf.processing import save_processor_files
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer
    from dsv4flash.tasks.hf_tokenizer import save_hf_tokenizer

    ref = Transformer("tiny", seed=0).eval()
    root = tmp_path_factory.mktemp("r3_rows")
    base = save_base(ref, ref.cfg, TaskTokenizer(ref.cfg), root / "base", {"kind": "test"})
    tok_dir = save_processor_files(base, save_hf_tokenizer(TaskTokenizer(ref.cfg), root / "verl_tokenizer"))
    model_config = HFModelConfig(path=str(base), tokenizer_path=str(tok_dir))
    return ref, model_config


def _worker(model_config):
    """veRL's `AgentLoopWorker` without its Ray servers: the post-processing methods run as they are."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = object.__new__(AgentLoopWorker)
    worker.rollout_config = SimpleNamespace(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    worker.tokenizer, worker.processor = model_config.tokenizer, model_config.processor
    worker.reward_loop_worker_handles, worker.distillation_enabled, worker.mm_processor_kwargs = None, False, {}
    return worker


def _rollout(ref, processor, seed: int):
    """One sampled trajectory as the rollout returns it: expanded prompt ids, response ids, compact routes."""
    from dsv4flash.model.image import ImageInput
    from dsv4flash.replay import ImageSpanLayout
    from dsv4flash.replay.reference import record_routes
    from dsv4flash.tasks import build_task

    ex = build_task("geometry").sample(np.random.default_rng(seed))
    tok = processor.tokenizer
    out = processor(text=[tok.bos_token + ex.prompt], images=list(ex.images), return_tensors="pt")
    response = tok(ex.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.cat([out["input_ids"][0], torch.tensor(response)])
    types = torch.cat([out["token_types"][0], torch.full((len(response),), -1)])
    images = [ImageInput(p, tuple(int(v) for v in g))
              for p, g in zip(out["pixel_values"].split([int(h * w) for h, w in out["image_grid_hw"].tolist()]),
                              out["image_grid_hw"])]
    with torch.no_grad(), record_routes(ref) as records:
        ref(ids[None], types[None], images)
    native = torch.stack(records, dim=1)  # [S_e, L, k]: the experts the model picks on every expanded row
    layout = ImageSpanLayout.from_token_types(types)
    compact = native[layout.expanded_rows()].clone()[:-1]  # one row per compact token, none for the last
    compact[~layout.compact_text_rows()[:-1]] = 0  # a placeholder's row is never replayed
    return ex, out["input_ids"][0].tolist(), response, compact, native, types


def _batch(setup, seeds):
    """veRL's agent-loop post-processing and the trainer's unpadding of a batch of rollouts."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.workers.utils import padding

    ref, model_config = setup
    worker, natives, types = _worker(model_config), [], []
    outputs = []
    for seed in seeds:
        ex, prompt_ids, response, compact, native, t = _rollout(ref, model_config.processor, seed)
        out = AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response, response_mask=[1] * len(response),
                              routed_experts=compact.numpy(), multi_modal_data={"images": list(ex.images)},
                              num_turns=2, metrics=AgentLoopMetrics())
        outputs.append(asyncio.run(worker._agent_loop_postprocess(out, validate=False, raw_prompt=[])))
        natives.append(native)
        types.append(t)
    data = worker._postprocess(outputs).to_tensordict()
    return padding.left_right_2_no_padding(data), natives, types


def _replayed(td):
    """veRL's R3 alignment and replay mask with the batch's text-only keys (DSV41-VERL-004)."""
    from verl.utils.megatron import router_replay_utils as rru

    row_map, native_rows = td.get("r3_row_map", None), td.get("r3_native_rows", None)
    routes = rru.align_r3_router_replay_data(td["routed_experts"], td["input_ids"], row_map=row_map)
    mask = rru.build_r3_replay_mask(td["input_ids"], td["loss_mask"], row_map=row_map, native_rows=native_rows)
    return routes, mask


def test_replayed_text_rows_are_the_rollouts_experts(patch_form, setup, monkeypatch):
    from verl.utils.megatron import router_replay_utils as rru

    from dsv4flash.integrations.verl.replay_check import count_mismatches

    monkeypatch.setattr(rru, "device_name", "cpu")  # veRL fixes its device string at import
    td, natives, types = _batch(setup, seeds=(0, 3))
    assert td["r3_row_map"].is_nested and td["r3_native_rows"].is_nested
    routes, mask = _replayed(td)
    total_mismatch = total_replayed = 0
    for i, (r, m, native, t) in enumerate(zip(routes.unbind(), mask.unbind(), natives, types)):
        assert r.shape[0] == native.shape[0] == t.numel()  # expanded training rows
        image = t >= 0
        assert torch.equal(td["r3_native_rows"].unbind()[i], image)
        assert not bool((m.bool() & image).any()) and int(m.sum()) == int((~image).sum()) - 1  # all text but the last
        for layer in range(native.shape[1]):
            mismatch, replayed = count_mismatches(r[:, layer].long(), native[:, layer], m)
            total_mismatch, total_replayed = total_mismatch + mismatch, total_replayed + replayed
    assert total_mismatch == 0 and total_replayed > 0
    patch_form.record("row_maps", [t.tolist() for t in td["r3_row_map"].unbind()])
    patch_form.record("replayed", total_replayed)


def test_the_check_fails_on_stock_verls_row_for_row_routes(setup, monkeypatch):
    """Without the join, compact routes sit row for row on the expanded ids: the replay check counts mismatches."""
    from verl.utils.megatron import router_replay_utils as rru

    from dsv4flash.integrations.verl.replay_check import count_mismatches

    from verl.experimental.agent_loop import agent_loop  # noqa: F401  (imported before the block: a first
    from verl.workers.utils import padding  # noqa: F401  import inside it runs the plugin's post-import hook again)

    monkeypatch.setattr(rru, "device_name", "cpu")
    with stock(PATCH_ID):
        td, natives, types = _batch(setup, seeds=(0,))
        assert "r3_row_map" not in td.keys()
        routes, mask = _replayed(td)  # veRL's stock R3: every causal row, routes row for row
    r, m, native = routes.unbind()[0], mask.unbind()[0], natives[0]
    mismatch = sum(count_mismatches(r[:, layer].long(), native[:, layer], m)[0] for layer in range(native.shape[1]))
    assert mismatch > 0


def test_a_wrong_row_map_is_counted():
    """The check's own failure mode: routes shifted by one row mismatch the native experts."""
    from dsv4flash.integrations.verl.replay_check import count_mismatches

    native = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    mask = torch.tensor([True, True, True, False])
    assert count_mismatches(native[:, [1, 0]], native, mask) == (0, 3)  # order within a row does not matter
    assert count_mismatches(native.roll(1, dims=0), native, mask) == (3, 3)
