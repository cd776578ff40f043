"""engine=verl: the recipes compose into a complete veRL ppo_trainer config that veRL's own validator accepts."""

import json
import os
import subprocess
import sys

import pytest

from dsv4flash.config import load_config
from dsv4flash.train.compose import compose, to_train_config
from dsv4flash.train.verl_config import (VerlConfigError, build_verl_config, hydra_value,
                                         megatron_lora_targets)

pytestmark = pytest.mark.upstream

FLASH = ["engine=verl", "model=flash", "model.hf_path=/cluster/DeepSeek-V4.1-Flash"]


def _build(recipe: str, extra=(), tmp="/tmp/dsv4flash-verl-test"):
    cfg = to_train_config(compose(recipe, FLASH + list(extra)))
    return build_verl_config(cfg, data_dir=f"{tmp}/data", output_dir=tmp, reward_path=f"{tmp}/reward.py")


@pytest.fixture(scope="module")
def decoder_lora():
    return _build("decoder_lora")


def test_decoder_lora_validates_with_verls_schema(decoder_lora):
    c = decoder_lora
    assert c.actor_rollout_ref.actor.strategy == "megatron" and c.actor_rollout_ref.actor._target_.endswith(
        "McoreActorConfig")
    assert c.algorithm.adv_estimator == "grpo" and c.actor_rollout_ref.rollout.n == 8
    assert c.actor_rollout_ref.rollout.agent.num_workers == 8  # veRL's own default on a cluster
    assert c.actor_rollout_ref.rollout.name == "vllm" and c.actor_rollout_ref.rollout.calculate_log_probs
    assert c.actor_rollout_ref.rollout.enable_rollout_routing_replay
    assert c.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"
    assert c.algorithm.rollout_correction.rollout_is == "token"
    assert c.algorithm.rollout_correction.rollout_is_threshold == "0.5_5.0"  # IcePop band
    assert c.actor_rollout_ref.actor.optim.lr == 5e-5
    lora = c.actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha, lora.merge) == (16, 32, False)
    assert lora.freeze_vision_model and lora.freeze_language_model
    assert c.actor_rollout_ref.model.external_lib == "dsv4flash.integrations.verl.plugin"
    assert c.actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method == "uniform"


def test_decoder_half_targets_only_decoder_layers_and_freezes_kv_writers(decoder_lora):
    targets = list(decoder_lora.actor_rollout_ref.model.lora.target_modules)
    layers = {int(t.split(".layers.")[1].split(".")[0]) for t in targets}
    assert layers == set(range(20, 40))
    # layer 20 (the CED source) keeps its KV write and compressor base-only
    assert "*.layers.20.self_attention.linear_kv" not in targets
    assert not any("compressor" in t for t in targets if ".layers.20." in t)
    assert "*.layers.21.self_attention.linear_kv" in targets
    assert not any("indexer" in t or "router" in t for t in targets)
    assert "*.layers.39.mlp.experts.*linear_fc1" in targets


def test_full_linear_compresses_to_all_layer_patterns():
    mcfg = load_config("tiny")  # same translation as flash (checked above), 12 layers instead of 40
    from dsv4flash.lora import LoraConfig

    targets = megatron_lora_targets(mcfg, LoraConfig(preset="full_linear"))
    assert "*.layers.*.self_attention.linear_o_group_proj" in targets
    assert "*.layers.*.mlp.experts.*linear_fc2" in targets
    lean = megatron_lora_targets(mcfg, LoraConfig(preset="no_down_proj"))
    assert not any("experts.*linear_fc2" in t for t in lean) and "*.layers.*.mlp.shared_experts.linear_fc2" in lean


def test_cluster_recipe_is_the_studys_layout():
    c = _build("decoder_lora_cluster")
    assert (c.trainer.nnodes, c.trainer.n_gpus_per_node) == (4, 8)
    meg = c.actor_rollout_ref.actor.megatron
    assert (meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size) == (1, 1)
    assert (meg.context_parallel_size, meg.expert_model_parallel_size) == (2, 16)
    assert meg.dtype == "bfloat16" and c.actor_rollout_ref.rollout.dtype == "bfloat16"
    assert meg.optimizer_offload and not meg.param_offload
    recompute = meg.override_transformer_config
    assert (recompute.recompute_granularity, recompute.recompute_method, recompute.recompute_num_layers) == (
        "full", "uniform", 1)
    assert c.actor_rollout_ref.actor.use_dynamic_bsz and c.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 4096
    assert c.actor_rollout_ref.rollout.max_model_len == 4096
    assert c.actor_rollout_ref.actor.optim.lr == 5e-5 and c.algorithm.adv_estimator == "grpo"
    lora = c.actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha, lora.merge) == (16, 32, False)
    assert c.actor_rollout_ref.rollout.name == "vllm"


def test_tis_and_bypass_variants_validate():
    c = _build("full_linear_r8", ["algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.bypass=true"])
    assert c.algorithm.rollout_correction.rollout_is_threshold == 2.0
    assert c.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
    assert c.actor_rollout_ref.actor.policy_loss.rollout_correction.bypass_mode is True
    assert c.actor_rollout_ref.model.lora.rank == 8


def test_what_verl_cannot_express_is_a_clear_error():
    with pytest.raises(VerlConfigError, match="learning rate"):
        _build("vit_lr_0p1")
    with pytest.raises(VerlConfigError, match="GRPO"):
        _build("decoder_lora", ["algorithm=sft"])


def test_verl_rejects_a_bad_raw_override():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _build("decoder_lora", ["engine.overrides=['actor_rollout_ref.actor.not_a_key=1']"])
    with pytest.raises(VerlConfigError, match="divisible|must be"):
        _build("decoder_lora", ["engine.overrides=['data.train_batch_size=3']"])


def test_hydra_value_quoting():
    assert hydra_value("0.5_5.0") == "'0.5_5.0'" and hydra_value([1, "a'b"]) == "[1,'a\\'b']"
    assert hydra_value(None) == "null" and hydra_value(True) == "true" and hydra_value(5e-05) == "5e-05"


def _run(*args, cwd):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def test_cli_engine_verl_on_cpu_stops_after_validation(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: engine.launch=auto would launch")
    out = tmp_path / "run"
    # model.base=random: no trained base to default model.hf_path to, so the written files name no path here
    run = _run("dsv4flash.train", "+recipe=decoder_lora", "engine=verl", "model.base=random", "data.train_size=16",
               "data.val_size=8", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "not launching veRL (no CUDA GPU is visible" in run.stdout and "validated" in run.stdout
    assert (out / "verl_ppo_trainer.yaml").is_file() and (out / "launch_verl.sh").is_file()
    # the written config is a complete primary config for veRL's own entry point
    cfg_job = _run("verl.trainer.main_ppo", "--config-path", str(out), "--config-name", "verl_ppo_trainer", "--cfg",
                   "job", cwd=tmp_path)
    assert cfg_job.returncode == 0, cfg_job.stderr[-3000:]
    assert "adv_estimator: grpo" in cfg_job.stdout and "rollout_is_threshold: 0.5_5.0" in cfg_job.stdout
    # portable: no path of this machine in the config or the launch script; moved elsewhere, the script
    # launches main_ppo with the run directory's files wherever it now lies
    import shutil

    for written in ("verl_ppo_trainer.yaml", "launch_verl.sh"):
        text = (out / written).read_text()
        assert str(tmp_path) not in text and sys.executable not in text and "/work/" not in text, written
    assert "pkg://dsv4flash.tasks.verl_reward" in (out / "verl_ppo_trainer.yaml").read_text()
    moved = shutil.copytree(out, tmp_path / "elsewhere" / "run")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    script = subprocess.run(["bash", str(moved / "launch_verl.sh"), "--cfg", "job"], capture_output=True, text=True,
                            timeout=600, cwd=elsewhere, env=dict(os.environ, PYTHON=sys.executable))
    assert script.returncode == 0, script.stderr[-3000:]
    assert f"train_files: {moved}/verl_data/train.parquet" in script.stdout
    assert f"default_local_dir: {moved}/verl_checkpoints" in script.stdout
    assert (moved / "verl_data" / "train.parquet").is_file()

    import pyarrow.parquet as pq

    from dsv4flash.tasks.verl_reward import compute_score

    train = pq.read_table(out / "verl_data" / "train.parquet").to_pylist()
    assert len(train) == 16 and train[0]["data_source"] == "geometry"
    assert train[0]["images"][0]["bytes"][:4] == b"\x89PNG" and "<image>" in train[0]["prompt"][0]["content"]
    row = train[0]
    truth = row["reward_model"]["ground_truth"]
    assert compute_score(row["data_source"], truth, truth, row["extra_info"]) == 1.0
    assert compute_score(row["data_source"], "purple", truth, row["extra_info"]) == 0.0


def test_launch_needs_the_checkpoint_path(tmp_path):
    """Without a trained base to default to (model.base=random), launching without model.hf_path is an error."""
    from dsv4flash.train.verl_engine import run_verl

    cfg = to_train_config(compose("decoder_lora", ["engine=verl", "model.base=random", "engine.launch=force",
                                                   "data.train_size=8", "data.val_size=4"]))
    with pytest.raises(VerlConfigError, match="model.hf_path"):
        run_verl(cfg, tmp_path, log=lambda *_: None)


def test_the_cpu_recipe_defaults_to_the_trained_base_and_a_graded_reward(pretrained_base, tmp_path):
    """The README's veRL command names no base: model.hf_path is the trained tiny base the main job uses (found in
    the cache, not rebuilt), and the arithmetic reward gives partial credit, so a near answer scores above 0. The
    training file holds data.train_size rows: the fixed training set the local engine cycles over with that size."""
    import json

    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    from dsv4flash.tasks import TaskMixture, build_task
    from dsv4flash.tasks.verl_reward import compute_score
    from dsv4flash.train.verl_engine import run_verl

    lines = []
    cfg = to_train_config(compose("decoder_lora_verl_cpu", ["engine.launch=never",
                                                            f"model.cache_dir={pretrained_base.parents[2]}"]))
    result = run_verl(cfg, tmp_path / "run", log=lines.append)
    assert OmegaConf.load(result["config"]).actor_rollout_ref.model.path == str(pretrained_base)
    assert not any("building it" in line for line in lines), lines
    rows = pq.read_table(tmp_path / "run" / "verl_data" / "train.parquet").to_pylist()
    local = TaskMixture({"arithmetic": build_task("arithmetic")}, {"arithmetic": 1.0}, cfg.seed, cfg.data.val_size,
                        cfg.data.train_size)
    written = [(r["extra_info"]["prompt_text"], r["reward_model"]["ground_truth"]) for r in rows]
    assert cfg.data.train_size == 8 and written == [(ex.prompt, ex.answer) for _, ex in local.train_problems(8)]
    assert sorted(written) == sorted((ex.prompt, ex.answer) for _, ex in local.train_batch(0, 8))  # its 1st epoch
    row = rows[0]
    truth = row["reward_model"]["ground_truth"]
    assert json.loads(row["extra_info"]["task_options"]) == {"partial_credit": True}
    assert compute_score(row["data_source"], truth, truth, row["extra_info"]) == 1.0
    near = compute_score(row["data_source"], str(int(truth) + 1), truth, row["extra_info"])
    assert 0 < near < 0.5, near


def test_a_dsv4flash_base_gets_its_task_tokenizer_in_hf_form(tmp_path):
    """veRL loads the tokenizer through transformers: a base's task tokenizer is written in HF form and used."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from dsv4flash.engine.model_io import save_base
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer
    from dsv4flash.train.verl_engine import run_verl

    mcfg = load_config("tiny")
    base = save_base(Transformer(mcfg, seed=0), mcfg, TaskTokenizer(mcfg), tmp_path / "base", {"kind": "test"})
    cfg = to_train_config(compose("decoder_lora", ["engine=verl", "engine.launch=never", f"model.hf_path={base}",
                                                   "data.train_size=8", "data.val_size=4"]))
    out = tmp_path / "run"
    result = run_verl(cfg, out, log=lambda *_: None)
    written = OmegaConf.load(result["config"])
    assert written.actor_rollout_ref.model.tokenizer_path == "verl_tokenizer"  # run-relative, pinned at launch
    hf = AutoTokenizer.from_pretrained(str(out / "verl_tokenizer"))
    prompt = "how many triangles ? <image>"
    assert hf(prompt, add_special_tokens=False)["input_ids"] == TaskTokenizer(mcfg).encode(prompt)
    assert f"actor_rollout_ref.model.tokenizer_path=$here/verl_tokenizer" in (out / "launch_verl.sh").read_text()
    # The tiny base has a vision tower: the same directory is the V4.1 processor's (veRL's hf_processor loads it).
    from transformers import AutoProcessor

    assert type(AutoProcessor.from_pretrained(str(out / "verl_tokenizer"))).__name__ == "DeepseekV41Processor"


def test_the_cpu_recipe_publishes_to_a_run_relative_store_and_v1_is_refused(tmp_path):
    """engine.publish: the lifecycle section veRL's config carries (run-relative store, policy = recipe, pinned by
    launch_verl.sh); with veRL's v1 trainer, which has no trainer hook, it is a config-time error leaving nothing."""
    from omegaconf import OmegaConf

    from dsv4flash.engine.model_io import save_base
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer
    from dsv4flash.train.verl_engine import run_verl

    mcfg = load_config("tiny")
    base = save_base(Transformer(mcfg, seed=0), mcfg, TaskTokenizer(mcfg), tmp_path / "base", {"kind": "test"})
    out = tmp_path / "run"
    cfg = to_train_config(compose("decoder_lora_verl_cpu", [f"model.hf_path={base}", "engine.launch=never",
                                                            f"lifecycle.root={out}/lifecycle"]))
    written = OmegaConf.load(run_verl(cfg, out, log=lambda *_: None)["config"])
    section = OmegaConf.to_container(written.trainer.dsv4flash_lifecycle)
    placement = section.pop("placement")
    assert section == {"store": "lifecycle", "policy": "decoder_lora_verl_cpu"}
    # every revision carries the run's placement, so the server rebuilds the adapter's shell (the recipe's own)
    from dsv4flash.lora import LoraConfig
    from dsv4flash.train.preflight import lora_config

    assert LoraConfig.from_dict(json.loads(placement)) == lora_config(cfg.lora)
    assert written.trainer.save_freq == 1
    assert written.actor_rollout_ref.rollout.agent.num_workers == 2  # one per core, not veRL's 8
    assert "trainer.dsv4flash_lifecycle.store=$here/lifecycle" in (out / "launch_verl.sh").read_text()
    # by default the run publishes where every training run does: the user's store, under another policy if asked
    from dsv4flash.lifecycle.default_store import default_store

    mine = to_train_config(compose("decoder_lora_verl_cpu", [f"model.hf_path={base}", "engine.launch=never",
                                                             "lifecycle.policy=mine"]))
    written = OmegaConf.load(run_verl(mine, tmp_path / "mine", log=lambda *_: None)["config"])
    section = OmegaConf.to_container(written.trainer.dsv4flash_lifecycle)
    assert {k: section[k] for k in ("store", "policy")} == {"store": str(default_store()), "policy": "mine"}
    v1 = to_train_config(compose("decoder_lora_verl_cpu", [f"model.hf_path={base}", "engine.launch=never",
                                                           'engine.overrides=["trainer.use_v1=true"]']))
    with pytest.raises(VerlConfigError, match="engine.publish=true needs veRL's legacy trainer"):
        run_verl(v1, tmp_path / "v1", log=lambda *_: None)
    assert not (tmp_path / "v1" / "verl_ppo_trainer.yaml").exists() and not (tmp_path / "v1" / "verl_data").exists()


def test_image_tasks_read_through_the_image_prompt_dataset():
    """`data.custom_cls` is dsv4flash's ImagePromptDataset for an image task (geometry), veRL's own otherwise."""
    images = _build("decoder_lora", ["data=geometry"])
    assert (images.data.custom_cls.path, images.data.custom_cls.name) == (
        "pkg://dsv4flash.integrations.verl.dataset", "ImagePromptDataset")
    assert _build("decoder_lora", ["data=arithmetic"]).data.custom_cls.path is None
    sibling = to_train_config(compose("decoder_lora_verl_cpu_geometry", ["model.hf_path=/cluster/base"]))
    assert list(sibling.data.tasks) == ["geometry"] and sibling.engine.overrides == to_train_config(
        compose("decoder_lora_verl_cpu", ["model.hf_path=/cluster/base"])).engine.overrides


def _leaves(node, prefix=""):
    """(dotted key, value) of every leaf of a plain config container."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], node


@pytest.mark.slow  # ~40 s: the flavour's meta model for the LoRA placement, veRL's validators, the data export
def test_cluster_recipe_writes_the_studys_layout_with_no_local_path(tmp_path):
    """`+recipe=decoder_lora_cluster` through the CLI: the written config is the study's layout, and the only
    absolute path in it that is not veRL's own default (`/tmp/ray/session_latest/...`, `~/.verl/...`, the
    same on every node) is the cluster checkpoint the user named; the launch script has none."""
    from omegaconf import OmegaConf

    from dsv4flash.train.verl_config import compose_verl

    stock = dict(_leaves(OmegaConf.to_container(compose_verl(["model_engine=megatron"]), resolve=False)))

    hf_path = "/cluster/DeepSeek-V4.1-Flash"
    out = tmp_path / "run"
    run = _run("dsv4flash.train", "+recipe=decoder_lora_cluster", f"model.hf_path={hf_path}",
               "data.train_size=16", "data.val_size=8", f"output_dir={out}",
               f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "not launching veRL (no CUDA GPU is visible" in run.stdout or torch_gpus() > 0
    written = OmegaConf.load(out / "verl_ppo_trainer.yaml")
    absolute = [(k, v) for k, v in _leaves(OmegaConf.to_container(written, resolve=False))
                if isinstance(v, str) and v.startswith(("/", "~")) and stock.get(k) != v]
    assert absolute == [("actor_rollout_ref.model.path", hf_path)], absolute
    text = (out / "verl_ppo_trainer.yaml").read_text() + (out / "launch_verl.sh").read_text()
    assert str(tmp_path) not in text and sys.executable not in text and "/work/" not in text
    script = (out / "launch_verl.sh").read_text()
    assert '"${PYTHON:-python}" -m verl.trainer.main_ppo --config-path "$here" --config-name verl_ppo_trainer' in script
    c = OmegaConf.to_container(written, resolve=True)
    actor, rollout = c["actor_rollout_ref"]["actor"], c["actor_rollout_ref"]["rollout"]
    meg = actor["megatron"]
    assert (c["trainer"]["nnodes"], c["trainer"]["n_gpus_per_node"]) == (4, 8)
    assert (meg["tensor_model_parallel_size"], meg["pipeline_model_parallel_size"], meg["context_parallel_size"],
            meg["expert_model_parallel_size"]) == (1, 1, 2, 16)
    assert meg["dtype"] == rollout["dtype"] == "bfloat16" and meg["optimizer_offload"]
    recompute = meg["override_transformer_config"]
    assert (recompute["recompute_granularity"], recompute["recompute_method"]) == ("full", "uniform")
    assert actor["use_dynamic_bsz"] and actor["ppo_max_token_len_per_gpu"] == rollout["max_model_len"] == 4096
    assert actor["optim"]["lr"] == 5e-5 and rollout["name"] == "vllm"
    lora = c["actor_rollout_ref"]["model"]["lora"]
    assert (lora["rank"], lora["alpha"], lora["merge"]) == (16, 32, False)


def torch_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
