"""When transformers learns `deepseek_v41`: lazily after `import dsv4flash` (which imports no transformers),
at once if transformers' auto classes came first, and in processes where only veRL or vLLM loaded our plugin.
Each case runs in a fresh interpreter, so no earlier import in this test process can make it pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dsv4flash

TINY = Path(dsv4flash.__file__).parent / "data" / "tiny_config.json"

CHECK = """
import json, sys
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
config = AutoConfig.from_pretrained(sys.argv[1])
print(json.dumps({"config": type(config).__name__,
                  "causal_lm": AutoModelForCausalLM._model_mapping[type(config)].__name__,
                  "image_text": AutoModelForImageTextToText._model_mapping[type(config)].__name__}))
"""


def run_fresh(tmp_path: Path, before: str) -> dict:
    """Run `before` then CHECK in a fresh interpreter on a directory holding the tiny config.json."""
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    (tmp_path / "ckpt" / "config.json").write_text(TINY.read_text())
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", before + "\n" + CHECK, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


EXPECTED = {"config": "DeepseekV41Config", "causal_lm": "DeepseekV41ForCausalLM",
            "image_text": "DeepseekV41ForCausalLM"}


def test_import_dsv4flash_is_cheap_and_registers_later(tmp_path):
    before = ("import sys, dsv4flash\n"
              "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, 'import dsv4flash pulled it'\n"
              "import transformers\n"
              "assert 'dsv4flash.hf.configuration' not in sys.modules  # registered only when auto classes load\n")
    assert run_fresh(tmp_path, before) == EXPECTED


def test_transformers_first_then_dsv4flash(tmp_path):
    before = "from transformers import AutoModelForCausalLM, AutoModelForImageTextToText\nimport dsv4flash\n"
    assert run_fresh(tmp_path, before) == EXPECTED


def test_without_dsv4flash_transformers_does_not_know_the_type(tmp_path):
    (tmp_path / "config.json").write_text(TINY.read_text())
    code = "import sys\nfrom transformers import AutoConfig\nAutoConfig.from_pretrained(sys.argv[1])\n"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "deepseek_v41" in done.stderr  # so the other cases test our registration


def test_verl_plugin_registers(tmp_path):
    before = "import sys, verl\nassert 'dsv4flash' in sys.modules, 'the verl.plugins entry point did not load'\n"
    assert run_fresh(tmp_path, before) == EXPECTED


def test_vllm_plugin_registers(tmp_path):
    before = ("import sys\nfrom vllm.plugins import load_general_plugins\nload_general_plugins()\n"
              "assert 'dsv4flash' in sys.modules, 'the vllm.general_plugins entry point did not load'\n")
    assert run_fresh(tmp_path, before) == EXPECTED


def test_vllm_config_class_registered_first_is_kept(tmp_path):
    """vLLM's get_config registers its own flat config class for its engine; dsv4flash must not replace it."""
    before = ("from vllm.transformers_utils.config import _CONFIG_REGISTRY, _register_config_class\n"
              "_register_config_class('deepseek_v41', _CONFIG_REGISTRY['deepseek_v41'])\n"
              "import dsv4flash\n")
    code = before + ("import sys\nfrom transformers import AutoConfig\n"
                     "c = AutoConfig.from_pretrained(sys.argv[1])\nprint(type(c).__module__)\n")
    (tmp_path / "config.json").write_text(TINY.read_text())
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "vllm.transformers_utils.configs.deepseek_v41"
