"""`python -m dsv4flash.train +recipe=NAME [overrides]`: compose the recipe, then run its engine.

Hydra's own flags work as usual (`--cfg job` prints the resolved config, `--help`, `-m` sweeps). The
local engine builds the project's base model first when the recipe needs it and it is not cached yet; its first
line says so (and how many steps each part runs), then progress follows (engine/progress.py).
A config the model or engine cannot run (`dsv4flash.train.preflight`) is one line on stderr and exit
status 2, before anything is written; the run directory Hydra created for it is removed again.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from dsv4flash.train.compose import PRIMARY, config_path, to_train_config
from dsv4flash.train.preflight import RunConfigError, check_run
from dsv4flash.train.schema import UnknownKeyError, register_schemas

register_schemas()


def output_dir_of(cfg: Any) -> Path:
    """`output_dir=` when given, else the Hydra run directory."""
    if cfg.output_dir:
        return Path(cfg.output_dir).expanduser()
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run(cfg: Any, output_dir: Path) -> dict:
    """Check, then dispatch a typed run config to its engine -> a result dict (summary or veRL paths)."""
    check_run(cfg)
    if cfg.engine.name == "local":
        from dsv4flash.engine.progress import ProgressLog
        from dsv4flash.train.base_cache import PRETRAIN_RECIPE, base_key, cache_root, ensure_base, install_base

        progress = ProgressLog(cfg.engine.progress, log_file=output_dir / RUN_LOG)
        progress.print(announce(cfg, output_dir))  # before torch is imported: the first second says what comes
        from dsv4flash.engine import run_local
        from dsv4flash.engine.local import resolve_run

        try:  # engine.device/model.dtype auto, resolved once for the engine and the publisher
            cfg, _ = resolve_run(cfg)
        except ValueError as exc:  # device=cuda with no CUDA device visible, a misspelt device or dtype
            raise RunConfigError(str(exc)) from None
        base_dir = ensure_base(cfg, log=progress.print, progress=progress)
        publisher = None
        if cfg.lora.enabled and cfg.lifecycle.publish:
            from dsv4flash.train.publish import Publisher

            publisher = Publisher(cfg, base_dir, output_dir, log=progress.print)
        result = run_local(cfg, output_dir, base_dir=base_dir, log=progress, on_save=publisher)
        if cfg.recipe == PRETRAIN_RECIPE and result.model_dir is not None:
            slot = install_base(cfg, result.model_dir, cache_root(cfg))
            progress.print(f"base installed in the cache: {slot} (key {base_key(cfg)})")
        if publisher is not None and result.summary.get("published"):
            progress.print(publisher.next_steps())
        return result.summary
    if cfg.engine.name == "verl":
        from dsv4flash.train.verl_engine import run_verl

        return run_verl(cfg, output_dir)
    raise ValueError(f"engine.name must be 'local' or 'verl', got {cfg.engine.name!r}")


RUN_LOG = "train.log"  # in the output directory: every line the console showed, with the time of day


def announce(cfg: Any, output_dir: Path) -> str:
    """The run's first line: recipe, algorithm, steps, evaluations, and whether the base is cached or built first."""
    from dsv4flash.train.base_cache import PRETRAIN_RECIPE, base_plan, pretrain_config

    eng = cfg.engine
    base_dir, build = base_plan(cfg)
    if base_dir is None:
        base = "base: random init (model.base=random)"
    elif build:
        pcfg = pretrain_config(cfg)
        base = (f"base: not cached, building it first with +recipe={PRETRAIN_RECIPE} ({pcfg.engine.steps} steps, "
                f"once) into {base_dir.parent}")
    else:
        base = f"base: {base_dir}" + (" (cached)" if cfg.model.base == PRETRAIN_RECIPE else "")
    return (f"{cfg.recipe}: {cfg.algorithm.name} on {'+'.join(sorted(cfg.data.tasks))}, engine=local, {eng.steps} "
            f"steps x {eng.batch_size} prompts, eval every {eng.eval_every} steps; {base}; outputs and "
            f"{RUN_LOG} in {output_dir}")


# What Hydra itself writes into a run directory before the job starts.
HYDRA_BOOKKEEPING = {".hydra", "main.log", "__main__.log"}


def discard_unused_run_dir() -> None:
    """Remove the Hydra run directory (and emptied parents below the cwd) if it holds only Hydra's own files."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    cwd = Path.cwd().resolve()
    if run_dir == cwd or not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - HYDRA_BOOKKEEPING:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in run_dir.parents:
        if parent == cwd or cwd not in parent.parents or any(parent.iterdir()):
            break
        parent.rmdir()


@hydra.main(config_path=config_path(), config_name=PRIMARY, version_base=None)
def main(cfg: DictConfig) -> None:
    """Hydra entry point; config errors exit 2 with one line and leave no run directory."""
    try:
        typed = to_train_config(cfg)
        run(typed, output_dir_of(typed))
    except (RunConfigError, UnknownKeyError) as err:
        discard_unused_run_dir()
        print("error: " + " ".join(str(err).split()), file=sys.stderr)  # one line, even for veRL's messages
        raise SystemExit(2) from None
