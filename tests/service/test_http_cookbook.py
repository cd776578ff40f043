"""tinker-cookbook's own supervised and RL loops (`supervised.train.main`, `rl.train.main`), unmodified, against
`dsv4flash serve`: tiny base, built-in task data (`dsv4flash.integrations.cookbook` builders), and the server's
Hugging Face tokenizer directory as `model_name` (the cookbook's `get_tokenizer` loads it from disk)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import tinker  # noqa: F401  (the real SDK and cookbook: test dependencies, ci/install.sh test)
import tinker_cookbook  # noqa: F401

from tests.service.http_server import KEYS, rest_client


@pytest.fixture
def cookbook_env(server, monkeypatch):
    """The cookbook's ServiceClient reads its key from the environment; everything stays offline."""
    from tinker_cookbook.utils import cost_estimation

    monkeypatch.setenv("TINKER_API_KEY", KEYS["alice"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any hub lookup would fail: the tokenizer must come from disk
    # The cookbook's cost tracker downloads a pricing page once per process (and logs and continues when it
    # cannot); mark it fetched so the test makes no outside connection. Nothing else of the cookbook is touched.
    monkeypatch.setattr(cost_estimation, "_pricing_fetched", True)
    return server


def _served_base_dir(server) -> str:
    names = [m.model_name for m in rest_client(server).get_server_capabilities().result().supported_models]
    return next(n for n in names if Path(n).is_dir())


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _final_checkpoint(log_path: Path) -> dict:
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]
    return rows[-1]


@pytest.mark.slow
def test_cookbook_supervised_train_main_runs_against_the_server(cookbook_env, tmp_path):
    from tinker_cookbook.supervised import train
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from dsv4flash.integrations.cookbook import TaskSupervisedDatasetBuilder
    from dsv4flash.tasks.text_tokenizer import encode_task_text
    from dsv4flash.tasks import TaskTokenizer

    base = _served_base_dir(cookbook_env)
    text = "q : 12 + 7 = ? a : 19"
    assert encode_task_text(get_tokenizer(base), text) == TaskTokenizer("tiny").encode(text)
    log_path = tmp_path / "sft"
    config = train.Config(
        log_path=str(log_path), model_name=base, recipe_name="dsv4flash_task_sft", base_url=cookbook_env.url,
        dataset_builder=TaskSupervisedDatasetBuilder(model_name_for_tokenizer=base, task="arithmetic",
                                                     batch_size=4, n_batches=6, test_examples=4),
        learning_rate=2e-2, lora_rank=4, num_epochs=1, save_every=3, eval_every=3, lr_schedule="constant")
    asyncio.run(train.main(config))
    rows = [r for r in _metrics(log_path) if "train_mean_nll" in r]
    assert len(rows) == 6, rows
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"], [r["train_mean_nll"] for r in rows]
    assert any("test/nll" in r for r in _metrics(log_path))  # the cookbook's NLL evaluator ran (forward)
    final = _final_checkpoint(log_path)
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")
    run = rest_client(cookbook_env).get_training_run_by_tinker_path(final["state_path"]).result()
    assert run.lora_rank == 4 and run.base_model == base
    paths = [c.tinker_path for c in rest_client(cookbook_env).list_checkpoints(run.training_run_id).result().checkpoints]
    assert final["state_path"] in paths and final["sampler_path"] in paths


@pytest.mark.slow
def test_cookbook_rl_train_main_runs_against_the_server(cookbook_env, tmp_path):
    from tinker_cookbook.rl import train

    from dsv4flash.integrations.cookbook import TaskRLDatasetBuilder

    base = _served_base_dir(cookbook_env)
    log_path = tmp_path / "rl"
    config = train.Config(
        log_path=str(log_path), model_name=base, recipe_name="dsv4flash_task_rl", base_url=cookbook_env.url,
        dataset_builder=TaskRLDatasetBuilder(model_name_for_tokenizer=base, task="arithmetic", groups_per_batch=2,
                                             group_size=4, n_batches=3),
        learning_rate=1e-2, max_tokens=3, lora_rank=4, eval_every=0, save_every=0, loss_fn="importance_sampling")
    asyncio.run(train.main(config))
    rows = [r for r in _metrics(log_path) if any(k.startswith("env/all/") for k in r)]
    assert len(rows) == 3, rows
    assert all(0.0 <= r["env/all/reward/total"] <= 1.0 for r in rows)
    assert all(r["env/all/ac_tokens_per_turn"] <= 3 for r in rows)  # max_tokens reached the sampler
    # the cookbook compares the sampler's log-probs of its tokens with the trainer's forward: they must agree
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-4 for r in rows), [r["optim/kl_sample_train_v1"] for r in rows]
    assert all(r["tokens/trained"] > r["tokens/sampled"] > 0 for r in rows)
    final = _final_checkpoint(log_path)
    run = rest_client(cookbook_env).get_training_run_by_tinker_path(final["state_path"]).result()
    assert run.base_model == _served_base_dir(cookbook_env) and run.lora_rank == 4


@pytest.mark.slow
@pytest.mark.parametrize("loss_fn", ["stable_reinforce", "gspo"])
def test_cookbook_rl_train_main_with_tinker_038_losses(cookbook_env, tmp_path, loss_fn):
    # rl.train samples with record_stability_info and attaches each action's sequence_id as provenance for
    # stable_reinforce (its async default); gspo goes out without a sequence_ratio_mask, as the cookbook sends it.
    from tinker_cookbook.rl import train

    from dsv4flash.integrations.cookbook import TaskRLDatasetBuilder

    base = _served_base_dir(cookbook_env)
    log_path = tmp_path / loss_fn
    config = train.Config(
        log_path=str(log_path), model_name=base, recipe_name=f"dsv4flash_task_rl_{loss_fn}",
        base_url=cookbook_env.url,
        dataset_builder=TaskRLDatasetBuilder(model_name_for_tokenizer=base, task="arithmetic", groups_per_batch=2,
                                             group_size=4, n_batches=2),
        learning_rate=1e-2, max_tokens=3, lora_rank=4, eval_every=0, save_every=0, loss_fn=loss_fn)
    asyncio.run(train.main(config))
    rows = [r for r in _metrics(log_path) if any(k.startswith("env/all/") for k in r)]
    assert len(rows) == 2, rows
    assert all(r["tokens/trained"] > r["tokens/sampled"] > 0 for r in rows)
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-4 for r in rows)


def test_sdk_sampling_client_tokenizer_loads_offline_by_the_served_base_name(cookbook_env):
    from dsv4flash.tasks.text_tokenizer import encode_task_text
    from dsv4flash.tasks import TaskTokenizer
    from tests.service.http_server import service_client

    base = _served_base_dir(cookbook_env)
    with service_client(cookbook_env) as sdk:
        tc = sdk.create_lora_training_client(base_model=base, rank=4).result()
        text = "q : 3 + 4 = ? a : 7"
        for name, sampler in (("base", sdk.create_sampling_client(base_model=base).result()),
                              ("snapshot", tc.save_weights_and_get_sampling_client().result())):
            assert sampler.get_base_model() == base, name  # get_info answers with the served name
            assert encode_task_text(sampler.get_tokenizer(), text) == TaskTokenizer("tiny").encode(text)
