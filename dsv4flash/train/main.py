"""`python -m dsv4flash.train +recipe=NAME [overrides]`: compose the recipe, then run its engine.

Hydra's own flags work as usual (`--cfg job` prints the resolved config, `--help`, `-m` sweeps). The
local engine builds the project's base model first when the recipe needs it and it is not cached yet.
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
        from dsv4flash.engine import run_local
        from dsv4flash.engine.progress import ProgressLog
        from dsv4flash.train.base_cache import PRETRAIN_RECIPE, base_key, cache_root, ensure_base, install_base

        log = ProgressLog(cfg.engine.progress).print
        base_dir = ensure_base(cfg, log=log)
        result = run_local(cfg, output_dir, base_dir=base_dir)
        if cfg.recipe == PRETRAIN_RECIPE and result.model_dir is not None:
            slot = install_base(cfg, result.model_dir, cache_root(cfg))
            log(f"base installed in the cache: {slot} (key {base_key(cfg)})")
        return result.summary
    if cfg.engine.name == "verl":
        from dsv4flash.train.verl_engine import run_verl

        return run_verl(cfg, output_dir)
    raise ValueError(f"engine.name must be 'local' or 'verl', got {cfg.engine.name!r}")


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
