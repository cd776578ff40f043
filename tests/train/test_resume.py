"""Resume after an interruption is bit-identical to an uninterrupted run (SFT and GRPO, local engine); pretraining
is deterministic."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from dsv4flash.engine import run_local
from dsv4flash.engine.checkpoint import CheckpointMismatch
from dsv4flash.tasks import TASKS, ArithmeticTask
from dsv4flash.train.compose import compose, to_train_config


class EvenLength(ArithmeticTask):
    """Reward 1 when the decoded response has an even number of characters: an untrained model earns it
    about half the time, so GRPO groups carry signal from the first step."""

    name = "even_length"

    def reward(self, example, response):
        return 1.0 if len(response) % 2 == 0 else 0.0

SMALL = ["model.base=random", "engine.steps=4", "engine.batch_size=2", "engine.eval_every=2", "engine.log_every=1",
         "engine.checkpoint_every=2", "data.val_size=4", "engine.eval_generate=false", "engine.progress=off"]


def _cfg(algorithm: str, extra=()):
    over = SMALL + [f"algorithm={algorithm}", "lora.rank=4"] + list(extra)
    if algorithm == "grpo":
        over += ["algorithm.group_size=2", "algorithm.mini_batches=2", "engine.batch_size=4"]
    return to_train_config(compose("decoder_lora", over))


@pytest.mark.parametrize("algorithm", ["sft", "grpo"])
def test_resume_is_bit_identical(tmp_path, monkeypatch, algorithm):
    """... and so is what it publishes (python -m dsv4flash.train's `on_save`, each run into a store of its own)."""
    cfg = _cfg(algorithm)
    if algorithm == "grpo":
        monkeypatch.setitem(TASKS, "even_length", EvenLength)
        cfg.data.tasks = {"even_length": 1.0}
    straight = run_local(cfg, tmp_path / "straight", on_save=_publisher(cfg, tmp_path / "straight"))
    resumed_save = _publisher(cfg, tmp_path / "resumed")
    partial = run_local(cfg, tmp_path / "resumed", stop_after=2, on_save=resumed_save)  # "crash" after step 2's save
    assert partial.adapter_dir is None and partial.summary["stopped_at"] == 2
    assert partial.summary["published"]["step"] == 2  # the interrupted run's last checkpoint is in the store
    resumed = run_local(cfg, tmp_path / "resumed", on_save=resumed_save)
    a = load_file(straight.adapter_dir / "adapter_model.safetensors")
    b = load_file(resumed.adapter_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _history(straight) == _history(resumed)
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # it trained
    assert straight.summary["revision"]["revision"] == resumed.summary["revision"]["revision"]
    assert _policy_record(cfg, tmp_path / "straight") == _policy_record(cfg, tmp_path / "resumed")


def _publisher(cfg, out):
    """The run's `on_save` as `python -m dsv4flash.train` wires it, into `<out>/store`."""
    from dsv4flash.train.publish import Publisher

    cfg = dataclasses.replace(cfg, lifecycle=dataclasses.replace(cfg.lifecycle, root=str(out / "store")))
    return Publisher(cfg, None, out, log=lambda *_: None)


def _policy_record(cfg, out) -> list[tuple]:
    """Checks the policy record a run published into `<out>/store` -> (step, tensors) per revision, head first.

    Record: the base fingerprint; the placement; per revision the step, the tags `step-N`, the optimizer/RNG blob, the
    scheduler position and the data position (step, seed, run fingerprint); step 4 chained onto step 2."""
    from dsv4flash.config import load_config
    from dsv4flash.lifecycle import AdapterStore, base_fingerprint

    with AdapterStore.open(out / "store") as store:
        policy = store.policy(cfg.recipe)
        assert policy.base.digest == base_fingerprint(load_config(cfg.model.flavour)).digest
        assert policy.meta["placement"]["rank"] == 4 and policy.meta["algorithm"] == cfg.algorithm.name
        head, first = store.resolve(f"{cfg.recipe}:latest"), store.resolve(f"{cfg.recipe}:step-2")
        assert head.id == policy.head == store.resolve(f"{cfg.recipe}:step-4").id
        assert (head.step, head.parent, first.step, first.parent) == (4, first.id, 2, None)
        published = []
        for rev in (head, first):
            state, blob = store.trainer_state(cfg.recipe, rev.id)
            assert blob and state.step == rev.step and state.scheduler["step"] == rev.step
            assert state.data_position["step"] == rev.step and state.data_position["seed"] == cfg.seed
            assert store.load(rev.id).manifest.extra["placement"] == policy.meta["placement"]
            tensors = store.load_adapter(rev.id).to_packed_tensors()
            published.append((rev.step, {k: v.tolist() for k, v in sorted(tensors.items())}))
    return published


def _history(result) -> list[dict]:
    """metrics.jsonl without the wall-clock field."""
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "step_time"} for row in rows]


def test_resume_refuses_a_checkpoint_of_another_config(tmp_path):
    run_local(_cfg("sft"), tmp_path / "run", stop_after=2)
    with pytest.raises(CheckpointMismatch, match="another config"):
        run_local(_cfg("sft", ["lora.rank=8"]), tmp_path / "run")


def test_pretraining_is_deterministic(tmp_path):
    cfg = to_train_config(compose("pretrain_tiny", ["engine.steps=3", "engine.batch_size=4", "data.val_size=4",
                                                    "engine.eval_every=3", "engine.progress=off"]))
    a = run_local(cfg, tmp_path / "a").model_dir / "model.safetensors"
    b = run_local(cfg, tmp_path / "b").model_dir / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()
