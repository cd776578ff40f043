"""veRL's own `HFModelConfig` builds from the tiny and the flash config.json (AutoConfig knows `deepseek_v41`
once veRL loaded our plugin), and the project's veRL config validator builds it instead of skipping it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4flash.config import load_config

pytestmark = pytest.mark.upstream

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flavour", ["tiny", "flash"])
def test_hf_model_config_builds_in_a_fresh_verl_process(flavour, tmp_path):
    """Only `import verl` (its plugin entry point) makes AutoConfig know the type: run in a fresh interpreter."""
    load_config(flavour).save(tmp_path / "config.json")
    code = """
import json, sys
import verl
from verl.workers.config import HFModelConfig
c = HFModelConfig(path=sys.argv[1], load_tokenizer=False)
print(json.dumps({"hf_config": type(c.hf_config).__name__, "architectures": c.architectures,
                  "layers": c.hf_config.text_config.num_hidden_layers, "eos": c.generation_config.eos_token_id,
                  "tied": c.share_embeddings_and_output_weights, "json": c.hf_config.to_json_string()}))
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    cfg = load_config(flavour)
    assert got["hf_config"] == "DeepseekV41Config" and got["architectures"] == ["DeepseekV41ForCausalLM"]
    assert got["layers"] == cfg.text.num_hidden_layers and got["eos"] == cfg.eos_token_id and got["tied"] is False
    assert got["json"] == (tmp_path / "config.json").read_text()


def _verl_config(extra=()):
    from dsv4flash.train.compose import compose, to_train_config
    from dsv4flash.train.verl_config import compose_verl, verl_overrides

    cfg = to_train_config(compose("decoder_lora", ["engine=verl", "model=flash", *extra]))
    tmp = "/tmp/dsv4flash-verl-test"
    return cfg, compose_verl(verl_overrides(cfg, data_dir=f"{tmp}/data", output_dir=tmp, reward_path=f"{tmp}/r.py"))


@pytest.mark.slow
def test_validator_builds_hf_model_config_from_the_flavour():
    from verl.workers.config import HFModelConfig

    from dsv4flash.train.verl_config import validate_verl

    cfg, config = _verl_config(["model.hf_path=/cluster/DeepSeek-V4.1-Flash"])  # not on this machine
    typed = validate_verl(config, load_config(cfg.model.flavour))
    model = typed["model"]
    assert isinstance(model, HFModelConfig) and type(model.hf_config).__name__ == "DeepseekV41Config"
    assert model.hf_config.to_dsv4flash().to_hf() == load_config("flash").to_hf()


def test_validator_reads_a_local_checkpoint_and_rejects_the_wrong_config(tmp_path):
    from dsv4flash.train.verl_config import VerlConfigError, validate_verl

    load_config("flash").save(tmp_path / "config.json")
    cfg, config = _verl_config([f"model.hf_path={tmp_path}"])
    from omegaconf import open_dict

    with open_dict(config):
        config.actor_rollout_ref.model.load_tokenizer = False  # the directory holds no tokenizer
    assert validate_verl(config, load_config("flash"))["model"].local_path == str(tmp_path)
    load_config("tiny").save(tmp_path / "config.json")
    with pytest.raises(VerlConfigError, match="is not the 'flash' config"):
        validate_verl(config, load_config("flash"))
    with pytest.raises(VerlConfigError, match="model.path='/nowhere' is not a directory"):
        config.actor_rollout_ref.model.path = "/nowhere"
        validate_verl(config)
