"""The fixed-prompt weight-sync check (`dsv4flash.integrations.verl.sync_check`) on the real rollout server:
within 1e-5 of the model the actor holds after a correct sync, and failing when the sync is skipped or wrong.
The in-run measurement (the Megatron actor through veRL's `_compute_old_log_prob`) is checked from the run's
metrics in tests/verl/test_grpo_resume.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.verl.test_rollout_backend import LORA, _lora_model

pytestmark = [pytest.mark.upstream]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from dsv4flash.config import load_config
    from dsv4flash.engine import model_io
    from dsv4flash.lora import lora_state_dict, to_layout
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks.hf_tokenizer import save_hf_tokenizer
    from dsv4flash.tasks.tokenizer import TaskTokenizer

    root = tmp_path_factory.mktemp("sync_check")
    cfg = load_config("tiny")
    base = model_io.save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), root / "base", {"kind": "test"})
    model, _ = _lora_model(model_io.base_config(base), base_seed=0)  # the actor's model after its update
    tensors = {k: v.clone() for k, v in to_layout(lora_state_dict(model), "megatron").tensors.items()}
    tokenizer = AutoTokenizer.from_pretrained(save_hf_tokenizer(TaskTokenizer(cfg), root / "hf_tokenizer"))
    return base, model, tensors, tokenizer


def _server(base):
    from verl.workers.config import RolloutConfig

    from dsv4flash.integrations.verl.rollout.server import DSV4FlashRolloutServer

    server = DSV4FlashRolloutServer(RolloutConfig(name="dsv4flash", prompt_length=16, response_length=4,
                                                  dtype="float32", enable_rollout_routing_replay=True),
                                    {"path": str(base)}, rollout_mode=None, replica_rank=0)
    server.launch()
    return server


def _sync(server, tensors):
    peft = {"r": LORA["rank"], "lora_alpha": LORA["alpha"]}
    asyncio.run(server.load_weights(list(tensors.items()), peft_config=peft, base_sync_done=True, is_last=True))


def test_the_check_passes_after_a_sync_and_fails_when_it_is_skipped_or_wrong(setup):
    from dsv4flash.integrations.verl import sync_check

    base, model, tensors, tokenizer = setup
    ids = sync_check.fixed_prompt_ids(tokenizer, sync_check.DEFAULT_PROMPT)
    with torch.no_grad():  # the actor's log-probs of the fixed prompt, [1, S-1]
        actor = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)[:-1].gather(
            -1, torch.tensor(ids[1:])[:, None]).T
    server = _server(base)

    def measured() -> float:
        out = asyncio.run(server.generate(list(ids), sync_check.scoring_params(), request_id="check"))
        logprobs, routes = sync_check.rollout_scores(out, ids)
        assert routes is not None and routes.shape[0] == len(ids)  # the prompt's routes, for the actor's replay
        return sync_check.logprob_diff_max([logprobs], actor)

    skipped = measured()  # the server still serves the base: the update never arrived
    with pytest.raises(sync_check.SyncCheckError, match=r"fixed_prompt_logprob_diff_max = .* exceeds"):
        sync_check.check(skipped, 1e-5, "after the sync at step 1")
    _sync(server, tensors)
    assert sync_check.check(measured(), 1e-5, "after the sync at step 1") <= 1e-5
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    _sync(server, {**tensors, key: tensors[key] + 1e-2})  # one tensor of the sync is wrong
    wrong = measured()
    assert wrong > 1e-5
    with pytest.raises(sync_check.SyncCheckError):
        sync_check.check(wrong, 1e-5, "after the sync at step 2")
    with pytest.raises(sync_check.SyncCheckError):
        sync_check.check(float("nan"), 1e-5, "")
    assert sync_check.check(wrong, None, "") == wrong  # tolerance null: measure only


def test_the_actor_batch_is_a_training_batch_to_verls_padding_code(setup):
    """`actor_batch` goes through veRL's own padding conversions as `_compute_old_log_prob` sends it."""
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from dsv4flash.integrations.verl import sync_check

    *_, tokenizer = setup
    ids = sync_check.fixed_prompt_ids(tokenizer, sync_check.DEFAULT_PROMPT)
    routes = [torch.randint(0, 8, (len(ids), 3, 2)), torch.randint(0, 8, (len(ids), 3, 2))]
    batch = sync_check.actor_batch(ids, routes, rows=4)
    assert len(batch) == 4 and batch.meta_info["temperature"] == 1.0
    td = left_right_2_no_padding(batch.to_tensordict())
    assert td["input_ids"].values().tolist() == ids * 4
    assert torch.equal(td["routed_experts"].values().reshape(4, len(ids), 3, 2).long(),
                       torch.stack([routes[0], routes[1]] * 2))
    per_token = torch.arange(4 * len(ids), dtype=torch.float32)  # stands for the actor's per-token output
    assert no_padding_2_padding(per_token, td).shape == (4, len(ids) - 1)
    with pytest.raises(ValueError, match="needs at least 2"):
        sync_check.fixed_prompt_ids(tokenizer, "q")
