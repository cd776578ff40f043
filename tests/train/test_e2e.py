"""The main job end to end: `python -m dsv4flash.train +recipe=decoder_lora` with a reduced step count builds the
base (pretrain_tiny, cached), fine-tunes decoder-half LoRA, and writes adapter, revision, summary and plot."""

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
SMALL_BASE = "model.base_overrides=['engine.steps=4','engine.batch_size=4','data.val_size=4','engine.eval_every=2']"


def _train(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    return subprocess.run([sys.executable, "-m", "dsv4flash.train", *args, f"hydra.run.dir={tmp / 'hydra'}"],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)


def test_decoder_lora_default_command_end_to_end(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"
    args = ["+recipe=decoder_lora", "engine.steps=2", "engine.batch_size=4", "engine.eval_every=1",
            "data.val_size=4", f"model.cache_dir={cache}", SMALL_BASE, f"output_dir={out}"]
    first = _train(tmp_path, *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "building it with +recipe=pretrain_tiny" in first.stdout
    # piped: the first line says what the run does, then plain progress lines with rate and ETA, for the base
    # build's 4 steps, the fine-tuning's 2 and every evaluation; the run log holds the same lines
    lines = first.stdout.splitlines()
    assert lines[0].startswith("decoder_lora: sft on geometry, engine=local, 2 steps x 4 prompts") and \
        "base: not cached, building it first with +recipe=pretrain_tiny (4 steps, once)" in lines[0]
    progress = [line for line in lines if " steps/s  elapsed " in line or " examples/s  elapsed " in line]
    ends = ["train 1/4 (25%)", "train 4/4 (100%)", "train 1/2 (50%)", "train 2/2 (100%)"]  # + any due between
    beats = [line for line in progress if line.endswith("  working")]  # a step silent for 15 s (a loaded machine)
    assert [line.split("  ")[0] for line in progress if line.split("  ")[0] in ends and line not in beats] == ends
    assert sum(line.startswith("eval@") for line in progress) >= 3 + 3  # steps 0, 2, 4 of the base; 0, 1, 2 here
    logged = [entry.split(" ", 1)[1] for entry in (out / "train.log").read_text().splitlines()]
    assert logged == lines[:len(logged)] and "train 2/2 (100%)" in "\n".join(logged)
    bases = list((cache / "bases").glob("pretrain_tiny-*/model/model.safetensors"))
    assert len(bases) == 1

    adapter = out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16 and config["lora_alpha"] == 32
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all(".layers." not in n or int(n.split(".layers.")[1].split(".")[0]) >= 6 for n in names)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe"] == "decoder_lora" and summary["algorithm"] == "sft" and summary["steps"] == 2
    assert summary["lora"]["preset"] == "decoder_half" and summary["lora"]["layers"][0] == 6
    assert summary["val_loss_initial"] > 0 and summary["val_loss_final"] > 0
    revision = json.loads((out / "revision.json").read_text())
    assert revision["parent_base_sha256"] == summary["model"]["base_sha256"] and len(revision["revision"]) == 16
    assert (out / "loss_curve.png").stat().st_size > 1000
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all("val_loss" in r for r in rows)
    assert "step    2/2" in first.stdout

    # second run, GRPO: the base comes from the cache, nothing is rebuilt
    again = _train(tmp_path, *args[:-1], "algorithm=grpo", "algorithm.group_size=2",
                   f"output_dir={tmp_path / 'run2'}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "building it" not in again.stdout
    assert f"base: {bases[0].parent} (cached)" in again.stdout.splitlines()[0]
    grpo = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert grpo["algorithm"] == "grpo" and grpo["model"]["base_sha256"] == summary["model"]["base_sha256"]
    assert grpo["train_reward_first"] is not None and (tmp_path / "run2" / "adapter" / "adapter_config.json").is_file()


def test_pretrain_recipe_installs_the_base_fine_tuning_finds(tmp_path):
    from dsv4flash.train.base_cache import cached_base_dir, ensure_base
    from dsv4flash.train.compose import compose, to_train_config

    cache = tmp_path / "cache"
    small = ["engine.steps=3", "engine.batch_size=4", "data.val_size=4", "engine.eval_every=3"]
    built = _train(tmp_path, "+recipe=pretrain_tiny", *small, f"model.cache_dir={cache}",
                   f"output_dir={tmp_path / 'pre'}")
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "pre" / "model" / "model.safetensors").is_file()
    quoted = ",".join(f"'{o}'" for o in small)
    cfg = to_train_config(compose("decoder_lora", [f"model.cache_dir={cache}", f"model.base_overrides=[{quoted}]"]))
    slot = cached_base_dir(cfg)
    assert "base installed in the cache" in built.stdout and str(slot) in built.stdout
    assert ensure_base(cfg, log=lambda *_: None) == slot  # found, not rebuilt


def test_the_main_jobs_adapter_is_a_policy_the_server_samples_by_name(pretrained_base, tmp_path):
    """The newcomer's path of the README: the main command (shortened, on the shared trained base, so nothing is
    built) publishes its adapter into the default store; `dsv4flash lifecycle policies` lists the policy; and
    `dsv4flash serve --base tiny` (the same trained base, found in the same cache) samples
    `tinker://decoder_lora/weights/latest` through the real tinker SDK: its prompt log-probs are transformers + PEFT's
    on the run's adapter over that base, and its greedy answer is task text, not an untrained model's <unused…>."""
    import re

    import numpy as np
    import tinker
    from tinker import types

    from dsv4flash.lifecycle.default_store import default_store
    from dsv4flash.service.protocol.launch import ServerProcess
    from tests.service.http_server import peft_prompt_logprobs

    cache, out = pretrained_base.parents[2], tmp_path / "run"  # <cache>/bases/pretrain_tiny-<key>/model
    run = _train(tmp_path, "+recipe=decoder_lora", "engine.steps=2", "engine.batch_size=4", "engine.eval_every=2",
                 "data.val_size=4", "engine.eval_generate=false", f"model.cache_dir={cache}", f"output_dir={out}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "building it" not in run.stdout
    published = json.loads((out / "summary.json").read_text())["published"]
    assert published["store"] == str(default_store()) and published["policy"] == "decoder_lora"
    assert "sample model_path tinker://decoder_lora/weights/latest" in run.stdout  # the run says how to use it

    listed = subprocess.run([sys.executable, "-m", "dsv4flash", "lifecycle", "policies"], capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("decoder_lora "))
    assert f"head={published['revision'][:12]}" in row and f"latest={published['revision'][:12]}" in row, row

    with ServerProcess(default_store(), None, base="tiny", env={"DSV4FLASH_CACHE": str(cache)}) as server:
        assert "building it" not in server.log()
        key = re.search(r"\n  (tml-\S+)", server.log()).group(1)
        with tinker.ServiceClient(base_url=server.url, api_key=key) as sdk:
            sampler = sdk.create_sampling_client(model_path="tinker://decoder_lora/weights/latest").result()
            tokenizer = sampler.get_tokenizer()
            prompt = tokenizer.encode("q : 12 + 30 = ? a :", add_special_tokens=False)
            served = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:]
            answer = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                                    types.SamplingParams(max_tokens=4, temperature=0.0)).result().sequences[0].tokens
    np.testing.assert_allclose(peft_prompt_logprobs(pretrained_base, out / "adapter", prompt), served, rtol=0,
                               atol=1e-5)
    text = tokenizer.decode(answer)
    assert answer and "<unused" not in text, text
