"""engine=verl: export the tasks, compose + validate veRL's config, write it with a launch script, launch.

Launching calls `verl.trainer.main_ppo.run_ppo` with the validated config (Ray, the Megatron actor with the
dsv4flash plugin imported through `actor_rollout_ref.model.external_lib`, vLLM rollout). `engine.launch=auto`
launches only where CUDA GPUs are visible; on a CPU machine the run stops after validation and says so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dsv4flash.train.preflight import check_run
from dsv4flash.train.verl_config import (MODEL_PATH_UNSET, RUN_DIR_KEYS, VerlConfigError, build_verl_config,
                                         pin_run_dir)

CONFIG_NAME = "verl_ppo_trainer"
# Rows of veRL's training file when data.train_size is null (the local engine then draws without end; veRL
# reads a file, in epochs).
VERL_TRAIN_ROWS = 4096


def _gpus_visible() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install counts as no GPU
        return 0


def launch_script(config: DictConfig) -> str:
    """launch_verl.sh: veRL's own entry point on the config next to it, run-relative paths pinned at launch.

    Nothing in it names this machine: `python` comes from PATH (`PYTHON=` overrides) and the run directory
    is wherever the script lies, so it runs as is on a cluster head node or under
    `ray job submit --working-dir RUN_DIR -- bash launch_verl.sh`.
    """
    pins = "".join(f' \\\n  "{key}=$here/{OmegaConf.select(config, key)}"' for key in RUN_DIR_KEYS
                   if OmegaConf.select(config, key) is not None
                   and not os.path.isabs(str(OmegaConf.select(config, key))))
    return ("#!/usr/bin/env bash\n"
            "# Launch veRL GRPO with the validated config next to this script (run on the Ray head node).\n"
            "set -euo pipefail\n"
            'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
            f'exec "${{PYTHON:-python}}" -m verl.trainer.main_ppo --config-path "$here" --config-name {CONFIG_NAME}'
            f'{pins} \\\n  "$@"\n')


def write_config(config: DictConfig, output_dir: Path) -> tuple[Path, Path]:
    """`<out>/verl_ppo_trainer.yaml` (the complete config) and `<out>/launch_verl.sh` (main_ppo on it)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / f"{CONFIG_NAME}.yaml"
    tmp = path.with_name(f".{path.name}.tmp")
    OmegaConf.save(config, tmp)
    os.replace(tmp, path)
    script = output_dir / "launch_verl.sh"
    tmp = script.with_name(f".{script.name}.tmp")
    tmp.write_text(launch_script(config))
    tmp.chmod(0o755)
    os.replace(tmp, script)
    return path, script


def launch(config: DictConfig, run_dir: Path) -> None:
    """Run veRL's PPO/GRPO driver in this process (Ray cluster from `ray_kwargs`), as `main_ppo.main` does."""
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.utils.device import auto_set_device

    config = pin_run_dir(config, str(run_dir))
    auto_set_device(config)
    publishing = OmegaConf.select(config, "trainer.dsv4flash_lifecycle") is not None
    if config.trainer.use_v1:
        run_ppo(config, task_runner_class=TaskRunnerV1)
    elif publishing:
        from dsv4flash.integrations.verl.lifecycle_trainer import lifecycle_task_runner

        run_ppo(config, task_runner_class=lifecycle_task_runner())
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner

        run_ppo(config, task_runner_class=TaskRunner)


TASK_TOKENIZER_KIND = "dsv4flash-task-words"


def task_tokenizer_for(cfg: Any, out: Path) -> Path | None:
    """`<out>/verl_tokenizer` holding the HF form of the task tokenizer when `model.hf_path` is a dsv4flash base
    (its tokenizer.json is the task vocabulary, which transformers cannot read), and the V4.1 processor's files
    when the base has a vision tower; None for real checkpoints."""
    import json

    if not cfg.model.hf_path:
        return None
    own = Path(cfg.model.hf_path).expanduser() / "tokenizer.json"
    try:
        kind = json.loads(own.read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    if kind != TASK_TOKENIZER_KIND:
        return None
    from dsv4flash.tasks import TaskTokenizer
    from dsv4flash.tasks.hf_tokenizer import save_hf_tokenizer

    target = save_hf_tokenizer(TaskTokenizer.load(own.parent, cfg.model.flavour), out / "verl_tokenizer")
    from dsv4flash.engine.model_io import base_config

    if base_config(own.parent).vision.enabled:  # image prompts: veRL's hf_processor loads the V4.1 processor from here
        from dsv4flash.hf.processing import save_processor_files

        save_processor_files(own.parent, target)
    return target


def with_default_hf_path(cfg: Any, log=print) -> Any:
    """`cfg` with `model.hf_path` set to the project's trained base (the main job's, built and cached if missing)
    when it is unset, the flavour is one the local engine trains (tiny) and `model.base` is that base; else as is."""
    import dataclasses

    from dsv4flash.config import load_config
    from dsv4flash.engine.local import _check_local_size
    from dsv4flash.train.base_cache import PRETRAIN_RECIPE, ensure_base

    if cfg.model.hf_path or cfg.model.base != PRETRAIN_RECIPE:
        return cfg
    try:
        _check_local_size(load_config(cfg.model.flavour))
    except ValueError:  # too large for the local engine: no trained base of it here; the release checkpoint is needed
        return cfg
    base = ensure_base(cfg, log=log)
    log(f"model.hf_path unset: veRL loads the trained {cfg.model.flavour} base {base}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(base)))


def run_verl(cfg: Any, output_dir: str | Path, *, log=print) -> dict[str, Any]:
    """Export data, build and validate the veRL config, write it, and launch when the cluster is there."""
    from dsv4flash.tasks import TaskMixture, build_task
    from dsv4flash.tasks.verl_export import REWARD_FUNCTION_MODULE, export_parquet

    check_run(cfg)
    eng = cfg.engine
    if eng.launch not in ("auto", "never", "force"):
        raise VerlConfigError(f"engine.launch must be auto, never or force, got {eng.launch!r}")
    cfg = with_default_hf_path(cfg, log=log)
    out = Path(output_dir).resolve()
    data_dir = Path(eng.data_dir).resolve() if eng.data_dir else out / "verl_data"
    # Validate first: a config veRL rejects leaves nothing behind (no exported data, no run directory).
    made_out = not out.exists()
    tokenizer_dir = task_tokenizer_for(cfg, out)
    try:
        config = build_verl_config(cfg, data_dir=str(data_dir), output_dir=str(out),
                                   reward_path=REWARD_FUNCTION_MODULE,
                                   tokenizer_path=None if tokenizer_dir is None else str(tokenizer_dir))
        if eng.publish and config.trainer.use_v1:
            raise VerlConfigError("engine.publish=true needs veRL's legacy trainer (trainer.use_v1=false in "
                                  "engine.overrides): the lifecycle hook subclasses RayPPOTrainer")
    except Exception:
        if tokenizer_dir is not None:
            import shutil

            shutil.rmtree(tokenizer_dir, ignore_errors=True)
            if made_out and not any(out.iterdir()):
                out.rmdir()  # the run directory the tokenizer made
        raise
    tasks = {name: build_task(name, **dict(cfg.data.task_options.get(name, {}) or {})) for name in cfg.data.tasks}
    mixture = TaskMixture(tasks, dict(cfg.data.tasks), cfg.seed, cfg.data.val_size)
    train_size = VERL_TRAIN_ROWS if cfg.data.train_size is None else cfg.data.train_size
    files = export_parquet(mixture, data_dir, train_size=train_size,
                           task_options=dict(cfg.data.task_options))
    log(f"exported {train_size} training and {len(mixture.val)} validation rows to {data_dir}")
    cfg_path, script = write_config(config, out)
    log(f"veRL config validated by verl's own validator and written to {cfg_path}")
    lora = config.actor_rollout_ref.model.lora
    log(f"  GRPO n={config.actor_rollout_ref.rollout.n}, LoRA rank {lora.rank} alpha {lora.alpha} merge={lora.merge}, "
        f"{len(lora.target_modules)} target patterns, "
        f"router replay {config.actor_rollout_ref.actor.megatron.router_replay.mode}, "
        f"rollout correction {config.algorithm.rollout_correction.rollout_is}/"
        f"{config.algorithm.rollout_correction.rollout_is_threshold}")
    result = {"config": str(cfg_path), "launch_script": str(script), "data": {k: str(v) for k, v in files.items()},
              "launched": False}
    gpus = _gpus_visible()
    if eng.launch == "never" or (eng.launch == "auto" and gpus == 0):
        why = "engine.launch=never" if eng.launch == "never" else "no CUDA GPU is visible on this machine"
        log(f"not launching veRL ({why}). To launch: engine.launch=force here, or run {script} on the cluster.")
        return result
    if config.actor_rollout_ref.model.path == MODEL_PATH_UNSET:
        raise VerlConfigError("launching veRL needs model.hf_path: the HF-format checkpoint veRL, Megatron-Bridge and "
                              "vLLM load (e.g. model=flash model.hf_path=/data/DeepSeek-V4.1-Flash; for the tiny "
                              "flavour it defaults to the trained base)")
    log(f"launching verl.trainer.main_ppo on {config.trainer.nnodes}×{config.trainer.n_gpus_per_node} GPUs "
        f"({gpus} visible here)")
    launch(config, out)
    result["launched"] = True
    return result
