"""The real veRL GRPO run on CPU: `python -m dsv4flash.train +recipe=decoder_lora_verl_cpu` runs veRL's own
`main_ppo` (legacy `RayPPOTrainer.fit`) on a local Ray cluster (127.0.0.1, started and stopped by the run),
on the pretrained tiny base with the recipe's own reward (arithmetic with partial credit; the same run is the
resume test's uninterrupted reference):
the Megatron actor (CSA2 model through the bridge, 2 gloo ranks, EP=2, fp32, decoder-half LoRA with layer 6's
KV write frozen), the dsv4flash rollout backend, an unmerged LoRA sync every step.

Checked from the run's own log: 2 GRPO steps finish; after every sync veRL's rollout-vs-actor comparison
(`training/rollout_probs_diff_max`: the rollout server's per-token probabilities of the sampled responses
against the Megatron actor's recomputation) is within 1e-5; the rollout correction (TIS) reports its clipped
fractions; the actor checkpoint holds the unmerged adapter.

The image-prompt sibling (`+recipe=decoder_lora_verl_cpu_geometry`: geometry pictures, `ImagePromptDataset`, the
in-model ViT fed by veRL's batch through DSV41-VERL-012/014) checks the same numerics on image prompts, which
hold only if the actor's ViT sees the rollout's pixels, and the text-only routing replay in the run
(DSV41-VERL-013 + 004): every step the replayed text rows are the experts the actor's own router picks
(`actor/routing_replay/text_rows_mismatch` = 0 over `actor/routing_replay/text_rows_replayed` > 0) while image
rows route natively (`actor/routing_replay/image_rows_native` > 0).
"""

from __future__ import annotations

import pytest

from dsv4flash.bench.verl_step import step_metrics as _metrics
from tests.verl import _runs

pytestmark = [pytest.mark.slow, pytest.mark.upstream, pytest.mark.whole_machine]


@pytest.fixture(scope="module")
def run(verl_text_run):
    """The shared text run (tests/verl/conftest.py): the pretrained tiny base, the graded reward -> (run dir, log)."""
    _base, out, log = verl_text_run
    return out, log


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """`+recipe=decoder_lora_verl_cpu_geometry` on a seeded tiny base with the vision tower -> (run dir, log)."""
    from dsv4flash.config import load_config
    from dsv4flash.engine.model_io import save_base
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer

    root = tmp_path_factory.mktemp("verl_grpo_images")
    cfg = load_config("tiny")
    base = save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), root / "base", {"kind": "test"})
    out = root / "run"
    return out, _runs.run(_runs.command("decoder_lora_verl_cpu_geometry", base, out), out)


def test_two_grpo_steps_with_the_megatron_actor_and_the_dsv4flash_rollout(run):
    out, log = run
    steps = _metrics(log)
    assert {1, 2} <= set(steps), sorted(steps)
    assert "Training Progress: 100%" in log and "2/2" in log  # veRL's progress display
    # the README's example learns from something: the recipe's reward is not all zero on the trained base
    assert max(steps[step]["critic/score/mean"] for step in (1, 2)) > 0, [steps[s]["critic/score/mean"] for s in (1, 2)]
    for step in (1, 2):
        m = steps[step]
        assert m["training/global_step"] == step
        assert m["training/rollout_probs_diff_max"] <= 1e-5, m["training/rollout_probs_diff_max"]
        for key in ("critic/score/mean", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac",
                    "rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low",
                    "timing_s/update_weights", "timing_s/update_actor"):
            assert key in m, (step, key)
    assert "Streaming adapter weights" in log and "DSV41Bridge" in log  # the unmerged sync through the bridge
    assert "DSV4FlashRolloutServer" in log


def test_the_checkpoint_holds_the_unmerged_adapter(run):
    out, _ = run
    step = out / "verl_checkpoints" / "global_step_2" / "actor"
    assert (out / "verl_checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    adapter = step / "model" / "huggingface" / "adapter"
    assert adapter.is_dir() and any(adapter.iterdir())


def test_every_step_is_a_published_lifecycle_revision(run, verl_text_run):
    """The policy record of the run: head = step 2 chained onto step 1, each with veRL's step folder as trainer
    state, scheduler/data position, the base fingerprint and the rollout records of the batch it trained on."""
    import io
    import tarfile

    from omegaconf import OmegaConf

    from dsv4flash.engine.model_io import base_config
    from dsv4flash.integrations.verl.publish import step_adapter
    from dsv4flash.lifecycle import AdapterStore, base_fingerprint

    out, log = run
    base, _, _ = verl_text_run
    store = AdapterStore.open(out / "lifecycle")
    policy = store.policy("decoder_lora_verl_cpu")
    assert policy.base.digest == base_fingerprint(base_config(base)).digest
    head = store.resolve("decoder_lora_verl_cpu:head")
    first = store.resolve("decoder_lora_verl_cpu:step-1")
    assert head.step == 2 and head.parent == first.id and first.step == 1 and first.parent is None
    assert f"published step 2 as revision {head.id[:12]}" in log
    steps = _metrics(log)
    written = OmegaConf.load(out / "verl_ppo_trainer.yaml")
    for rev, step in ((first, 1), (head, 2)):
        loaded = store.load(rev.id, resident_base=policy.base)  # hash- and base-checked
        assert loaded.manifest.format == "packed_moe_lora/1" and loaded.manifest.step == step
        # the revision is veRL's checkpointed adapter of that step, bit for bit
        ckpt, _ = step_adapter(out / "verl_checkpoints" / f"global_step_{step}", base_config(base))
        expected = ckpt.to_packed_tensors()
        got = store.load_adapter(rev.id).to_packed_tensors()
        assert expected.keys() == got.keys() and all(torch_equal(expected[k], got[k]) for k in expected)
        state, blob = store.trainer_state("decoder_lora_verl_cpu", rev.id)
        assert state.step == step and state.scheduler["global_step"] == step
        assert state.scheduler["last_lr"] == [steps[step]["actor/lr"]]
        assert state.data_position["global_step"] == step
        names = tarfile.open(fileobj=io.BytesIO(blob)).getnames()
        assert "data.pt" in names and any(n.startswith("actor/") and "optim" in n for n in names), names[:20]
        records = store.catalog.rollouts("decoder_lora_verl_cpu", rev.id)
        assert len(records) == written.data.train_batch_size * written.actor_rollout_ref.rollout.n  # prompts x group
        assert {r["train_step"] for r in records} == {step}
        assert all("global_steps" in r and "uid" in r and r["adapter_version"] >= 1 for r in records), records[0]
    v1 = {r["adapter_version"] for r in store.catalog.rollouts("decoder_lora_verl_cpu", first.id)}
    v2 = {r["adapter_version"] for r in store.catalog.rollouts("decoder_lora_verl_cpu", head.id)}
    assert min(v2) > max(v1)  # step 2 sampled from the adapter synced after step 1's update


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_image_prompts_through_the_vit_with_text_only_routing_replay(image_run):
    out, log = image_run
    steps = _metrics(log)
    assert {1, 2} <= set(steps), sorted(steps)
    assert "ImagePromptDataset" in (out / "verl_ppo_trainer.yaml").read_text()
    for step in (1, 2):
        m = steps[step]
        # the rollout's image-prompt log-probs are the actor's only if the actor's ViT got the rollout's pixels
        assert m["training/rollout_probs_diff_max"] <= 1e-5, m["training/rollout_probs_diff_max"]
        assert m["actor/routing_replay/text_rows_replayed"] > 0 and m["actor/routing_replay/image_rows_native"] > 0, m
        assert m["actor/routing_replay/text_rows_mismatch"] == 0, m


def test_the_server_samples_a_published_step_by_name(run, verl_text_run, tmp_path):
    """A veRL revision carries the run's placement: the embedded service (what `dsv4flash serve` runs) samples
    `tinker://decoder_lora_verl_cpu/weights/step-2`, with transformers + PEFT's prompt log-probs on the revision's
    PEFT export, and not the bare base's."""
    import numpy as np

    from dsv4flash.lifecycle import AdapterStore
    from dsv4flash.lifecycle.export import export_peft
    from dsv4flash.service import ServiceClient, types
    from tests.service.http_server import peft_prompt_logprobs

    out, _ = run
    base, _, _ = verl_text_run
    with AdapterStore.open(out / "lifecycle") as store:
        export_peft(store.load_adapter("decoder_lora_verl_cpu:step-2"), tmp_path / "peft",
                    base_model_name_or_path=str(base))
    service = ServiceClient(root=out / "lifecycle", base_dir=base)
    sampler = service.create_sampling_client(model_path="tinker://decoder_lora_verl_cpu/weights/step-2")
    prompt = types.ModelInput.from_ints(service.get_tokenizer().encode("q : 12 + 30 = ? a :"))
    served = sampler.compute_logprobs(prompt).result()[1:]
    bare = service.create_sampling_client(base_model=service.base.base_model).compute_logprobs(prompt).result()[1:]
    np.testing.assert_allclose(peft_prompt_logprobs(base, tmp_path / "peft", prompt.to_ints()), served, rtol=0,
                               atol=1e-5)
    assert served != bare  # the adapter is applied
    answer = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert len(answer.sequences[0].tokens) >= 1
