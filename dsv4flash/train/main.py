"""`python -m dsv4flash.train +recipe=NAME [overrides]`: compose the recipe, then run its engine.

Hydra's own flags work as usual (`--cfg job` prints the resolved config, `--help`, `-m` sweeps). The
local engine builds the project's base model first when the recipe needs it and it is not cached yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from dsv4flash.train.compose import PRIMARY, config_path, to_train_config
from dsv4flash.train.schema import register_schemas

register_schemas()


def output_dir_of(cfg: Any) -> Path:
    """`output_dir=` when given, else the Hydra run directory."""
    if cfg.output_dir:
        return Path(cfg.output_dir).expanduser()
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run(cfg: Any, output_dir: Path) -> dict:
    """Dispatch a typed run config to its engine -> a result dict (summary or veRL paths)."""
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


@hydra.main(config_path=config_path(), config_name=PRIMARY, version_base=None)
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    typed = to_train_config(cfg)
    run(typed, output_dir_of(typed))
