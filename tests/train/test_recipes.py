"""Recipe tree: every recipe and algorithm composes into the typed schema; misspelt keys are clear errors."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from dsv4flash.train.compose import available_recipes, compose, config_path, to_train_config
from dsv4flash.train.schema import DPOAlgo, GRPOAlgo, LocalEngine, SFTAlgo, TrainConfig, UnknownKeyError, VerlEngine

REPO = Path(__file__).resolve().parents[2]
STUDY_RECIPES = {"decoder_lora", "full_linear_r16", "full_linear_r8", "encoder_half", "lean_attention",
                 "no_down_proj", "vit_lr_0p1"}
EXPECTED_PRESET = {"decoder_lora": "decoder_half", "full_linear_r16": "full_linear", "full_linear_r8": "full_linear_r8",
                   "encoder_half": "encoder_half", "lean_attention": "lean_attention", "no_down_proj": "no_down_proj",
                   "vit_lr_0p1": "vit_lr_0p1"}


def test_recipe_set_is_complete():
    assert set(available_recipes()) >= STUDY_RECIPES | {"pretrain_tiny"}


@pytest.mark.parametrize("recipe", sorted(STUDY_RECIPES | {"pretrain_tiny"}))
@pytest.mark.parametrize("algorithm", [None, "sft", "dpo", "grpo"])
def test_every_recipe_composes_typed(recipe, algorithm):
    overrides = [f"algorithm={algorithm}"] if algorithm else []
    cfg = to_train_config(compose(recipe, overrides))
    assert isinstance(cfg, TrainConfig) and isinstance(cfg.engine, LocalEngine)
    assert cfg.recipe == recipe
    want = {"sft": SFTAlgo, "dpo": DPOAlgo, "grpo": GRPOAlgo}
    if algorithm:
        assert isinstance(cfg.algorithm, want[algorithm])
    if recipe in STUDY_RECIPES:
        assert cfg.lora.enabled and cfg.lora.preset == EXPECTED_PRESET[recipe]
        assert cfg.optim.lr == 5e-5  # the study's learning rate (engine=verl uses it as is)
        from dsv4flash.lora import LoraConfig

        resolved = LoraConfig(preset=cfg.lora.preset)
        assert resolved.alpha == 2 * resolved.rank  # the study's alpha = 2·rank
    else:
        assert not cfg.lora.enabled and cfg.algorithm.name == (algorithm or "pretrain") and cfg.model.base == "random"


def test_decoder_lora_defaults():
    cfg = to_train_config(compose("decoder_lora"))
    assert cfg.algorithm.name == "sft" and isinstance(cfg.engine, LocalEngine)  # the study's objective locally
    assert cfg.data.tasks == {"geometry": 1.0} and cfg.model.base == "pretrain_tiny"
    verl = to_train_config(compose("decoder_lora", ["engine=verl"]))
    assert isinstance(verl.engine, VerlEngine) and verl.lora.preset == "decoder_half"
    assert isinstance(verl.algorithm, GRPOAlgo)  # the cluster path always runs GRPO
    grpo = verl.algorithm.rollout_correction
    assert (grpo.mode, grpo.lower, grpo.upper) == ("icepop", 0.5, 5.0)
    assert to_train_config(compose("decoder_lora", ["engine=verl", "algorithm=dpo"])).algorithm.name == "dpo"


def test_the_grpo_example_samples_its_whole_training_set_every_step():
    """decoder_lora_grpo (README, docs/recipes.md "The GRPO example"): GRPO on the embedded engine, decoder-half LoRA,
    the veRL CPU recipe's task and graded reward, every problem of the fixed training set in every step."""
    cfg = to_train_config(compose("decoder_lora_grpo"))
    verl = to_train_config(compose("decoder_lora_verl_cpu"))
    assert (cfg.algorithm.name, cfg.engine.name, cfg.lora.preset) == ("grpo", "local", "decoder_half")
    assert (cfg.data.tasks, cfg.data.task_options) == (verl.data.tasks, verl.data.task_options)
    assert cfg.data.task_options["arithmetic"]["partial_credit"] and cfg.model.base == "pretrain_tiny"
    assert cfg.engine.batch_size == cfg.data.train_size * cfg.algorithm.group_size


def test_recipe_files_hold_only_deltas():
    root = Path(config_path()) if not config_path().startswith("pkg://") else REPO / "recipes"
    for path in (root / "recipe").glob("*.yaml"):
        text = path.read_text()
        assert text.startswith("# @package _global_"), path
        assert "override /" in text, f"{path} should select groups, not restate them"
        assert len(text.splitlines()) < 45, f"{path} is long for a delta file"


@pytest.mark.parametrize("override, key", [
    ("engine.stepz=3", "engine.stepz"),
    ("algorithm.group_sise=4", "algorithm.group_sise"),
    ("lora.rnak=8", "lora.rnak"),
    ("optim.learning_rate=1e-3", "optim.learning_rate"),
])
def test_misspelt_key_is_a_clear_error(override, key):
    with pytest.raises(ConfigCompositionException, match=key.replace(".", r"\.")):
        compose("decoder_lora", [override])


@pytest.mark.parametrize("override, message", [
    ("+engine.stepz=3", "engine.stepz.*did you mean engine.steps"),
    ("+algorithm.group_sise=4", "algorithm.group_sise.*did you mean algorithm.group_size"),
    ("+lora.rnak=8", "lora.rnak.*did you mean lora.rank"),
    ("+typo_at_root=1", "typo_at_root"),
])
def test_misspelt_key_added_with_plus_is_rejected_by_the_schema(override, message):
    # Hydra lets `+` add keys to structured nodes and to_object would drop them silently.
    with pytest.raises(UnknownKeyError, match=message):
        to_train_config(compose("decoder_lora", ["algorithm=grpo", override]))
    with pytest.raises(UnknownKeyError, match="rollout_correction.lowr.*did you mean .*lower"):
        to_train_config(compose("decoder_lora", ["algorithm=grpo", "+algorithm.rollout_correction.lowr=0.1"]))


def test_wrong_type_is_a_clear_error():
    with pytest.raises(ConfigCompositionException) as err:
        compose("decoder_lora", ["engine.steps=many"])
    assert "steps" in str(err.value) + str(err.value.__cause__)


def _cli(*args, cwd, timeout=120):
    # run outside the repo: a job that reaches the app creates Hydra's run directory under the cwd
    return subprocess.run([sys.executable, "-m", "dsv4flash.train", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def test_cli_misspelt_key_and_unknown_recipe(tmp_path):
    bad = _cli("+recipe=decoder_lora", "engine.stepz=3", cwd=tmp_path)
    assert bad.returncode != 0 and "engine.stepz" in bad.stderr
    added = _cli("+recipe=decoder_lora", "+engine.stepz=3", "output_dir=/nonexistent/never-written", cwd=tmp_path)
    assert added.returncode != 0 and "did you mean engine.steps" in added.stderr
    unknown = _cli("+recipe=decoder_lora_typo", cwd=tmp_path)
    assert unknown.returncode != 0 and "decoder_lora_typo" in unknown.stderr and "decoder_lora" in unknown.stderr


def test_cli_cfg_job_prints_resolved_config(tmp_path):
    out = _cli("+recipe=decoder_lora", "--cfg", "job", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "preset: decoder_half" in out.stdout and "recipe: decoder_lora" in out.stdout
    assert "name: sft" in out.stdout and "steps: 100" in out.stdout
    verl = _cli("+recipe=decoder_lora", "engine=verl", "--cfg", "job", cwd=tmp_path)
    assert verl.returncode == 0 and "mode: icepop" in verl.stdout and "router_replay: R3" in verl.stdout


def test_main_command_help_and_readme_say_what_runs(tmp_path):
    # what +recipe=decoder_lora runs by default ...
    cfg = to_train_config(compose("decoder_lora"))
    assert (cfg.algorithm.name, cfg.engine.name) == ("sft", "local")
    # ... is what --help and the README's main command say
    help_text = _cli("--help", cwd=tmp_path)
    assert help_text.returncode == 0, help_text.stderr
    assert "+recipe=decoder_lora, fine-tunes decoder-half LoRA" in help_text.stdout
    assert "SFT (algorithm=sft" in help_text.stdout and "engine=local" in help_text.stdout
    readme = (REPO / "README.md").read_text()
    main_job = readme[readme.index("Install and run the main job"):readme.index("+recipe=decoder_lora\n```")]
    assert "fine-tuned with SFT" in main_job and "GRPO on the built-in" not in main_job
    assert list(tmp_path.iterdir()) == []  # --help writes no run directory
