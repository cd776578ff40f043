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
