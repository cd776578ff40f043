"""Bad input is a one-line error naming the key and the allowed values, before anything is written or started."""

import os
import re
import subprocess
import sys

import pytest

from dsv4flash.train.compose import compose, to_train_config
from dsv4flash.train.preflight import RunConfigError, check_run

pytestmark = pytest.mark.upstream

VERL = ["engine=verl"]


def _check(*overrides, recipe="decoder_lora"):
    check_run(to_train_config(compose(recipe, list(overrides))))


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=-1"], r"lora\.rank must be a positive int, got -1"),
    (["lora.dropout=1.5"], r"lora\.dropout must lie in \[0, 1\)"),
    (["lora.include=[layers.6.attn.wkv]"],
     r"lora\.include rule 'layers\.6\.attn\.wkv' selects only \['layers\.6\.attn\.wkv'\], which "
     r"lora\.freeze_kv_write=true keeps frozen .*allowed: .*lora\.freeze_kv_write=false"),
    (["lora.include=[layers.*.attn.indexer.wq_b]"], r"lora: .*indexer never gets LoRA"),
    (["data.train_size=0"], r"data\.train_size=0: expected a positive number of training problems, or null"),
])
def test_lora_and_data_errors_name_the_key(overrides, message):
    for engine in ([], VERL):
        with pytest.raises(RunConfigError, match=message):
            _check(*overrides, *engine)


def test_lora_rule_on_frozen_and_adaptable_modules_is_fine():
    _check("lora.include=[layers.*.attn.wkv]", *VERL)  # layers 7.. are adaptable: the frozen one is left out
    _check("lora.include=[layers.6.attn.wkv]", "lora.freeze_kv_write=false", *VERL)


@pytest.mark.parametrize("overrides, message", [
    (["engine.tensor_model_parallel_size=2"], r"engine\.tensor_model_parallel_size=2: allowed: 1"),
    (["engine.pipeline_model_parallel_size=2"], r"engine\.pipeline_model_parallel_size=2: allowed: 1"),
    (["engine.expert_model_parallel_size=3"],
     r"engine\.expert_model_parallel_size=3 must divide both the 8 routed experts of model=tiny and the 8 "
     r"ranks; allowed: \[1, 2, 4, 8\]"),
    (["engine.expert_model_parallel_size=16", "engine.nnodes=2"], r"allowed: \[1, 2, 4, 8\]"),
    (["engine.context_parallel_size=3"], r"engine\.context_parallel_size=3 must divide the 8 ranks .*allowed: "
                                         r"\[1, 2, 4, 8\]"),
    (["engine.context_parallel_size=2"],
     r"engine\.context_parallel_size=2 with image prompts \(data\.tasks \['geometry'\]\): .*allowed: "
     r"engine\.context_parallel_size=1 with image tasks, or text tasks only \['arithmetic', 'countdown'\]"),
    (["engine.rollout_tensor_parallel_size=16"], r"engine\.rollout_tensor_parallel_size=16 must divide the 8 ranks"),
    (["engine.rollout=sglangg"], r"engine\.rollout='sglangg' is not a rollout backend registered with veRL; "
                                 r"allowed: \[.*'vllm'.*\]"),
    (["engine.dtype=float64"], r"engine\.dtype='float64': allowed: \['bfloat16', 'float16', 'float32'\]"),
    (["engine.max_length=64"], r"engine\.max_length=64 is below .* = 72; allowed: >= 72"),
    (["engine.agent_loop_workers=0"], r"engine\.agent_loop_workers=0 must be a positive number of processes"),
])
def test_verl_layout_errors_name_the_key_and_the_allowed_values(overrides, message):
    with pytest.raises(RunConfigError, match=message):
        _check(*overrides, *VERL)


FLASH = ["model=flash", "model.hf_path=/cluster/ckpt", "engine.nnodes=4", *VERL]


def test_flash_layouts():
    _check("engine.expert_model_parallel_size=16", *FLASH)  # 384 experts, 32 ranks
    with pytest.raises(RunConfigError, match=r"384 routed experts of model=flash and the 32 ranks; allowed: "
                                             r"\[1, 2, 4, 8, 16, 32\]"):
        _check("engine.expert_model_parallel_size=64", *FLASH)


def test_context_parallel_runs_text_tasks():
    _check("engine.context_parallel_size=2", "data=arithmetic", *VERL)
    _check("engine.context_parallel_size=2", "data=countdown", *FLASH)


# One CLI run per case: the key's name first, the allowed values in the line.
CLI_CASES = {
    "lora rank": ("lora.rank=-1", "lora.rank", "must be a positive int"),
    "rollout backend": ("engine.rollout=bogus", "engine.rollout", r"allowed: \[.*'vllm'"),
    "EP not dividing the experts": ("engine.expert_model_parallel_size=3", "engine.expert_model_parallel_size",
                                    r"8 routed experts .*allowed: \[1, 2, 4, 8\]"),
    "CP splitting image spans": ("engine.context_parallel_size=2", "engine.context_parallel_size",
                                 r"image prompts .*allowed: engine\.context_parallel_size=1 with image tasks"),
    "LoRA on the frozen KV write": ("lora.include=[layers.6.attn.wkv]", "lora.include",
                                    r"keeps frozen .*allowed: .*lora\.freeze_kv_write=false"),
    "veRL's own validator": ("engine.overrides=['data.train_batch_size=3']", "veRL rejected the composed config",
                             r"divisible|must be"),
}


@pytest.mark.slow  # 6-25 s per case (the rollout registry check imports veRL)
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_exits_2_with_one_line_before_ray_and_leaves_no_run_directory(tmp_path_factory, case):
    override, key, allowed = CLI_CASES[case]
    cwd, ray_tmp = tmp_path_factory.mktemp("cwd"), tmp_path_factory.mktemp("ray")
    out = cwd / "run"
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmp), TMPDIR=str(ray_tmp))  # where a Ray session would be made
    run = subprocess.run([sys.executable, "-m", "dsv4flash.train", "+recipe=decoder_lora", "engine=verl", override,
                          f"output_dir={out}"], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()  # third-party import warnings may come first
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [lines[-1]] and errors[0].startswith(f"error: {key}"), run.stderr[-3000:]
    assert re.search(allowed, errors[0]), errors[0]
    assert "Traceback" not in run.stderr
    assert not out.exists() and list(cwd.iterdir()) == [], list(cwd.rglob("*"))
    assert not list(ray_tmp.glob("ray*")), "a Ray session was started"  # ray.init makes RAY_TMPDIR/ray/session_*


def test_flash_layer_20_kv_write_is_frozen():
    with pytest.raises(RunConfigError, match=r"lora\.include rule 'layers\.20\.attn\.wkv' selects only "
                                             r"\['layers\.20\.attn\.wkv'\], which lora\.freeze_kv_write=true keeps "
                                             r"frozen \(layer 20 writes the shared KV\)"):
        _check("lora.include=[layers.20.attn.wkv]", *FLASH)
