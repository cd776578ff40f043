"""Where the recipe tree lives and how to compose a recipe outside `hydra.main` (tests, base builds).

Installed, the tree is the package `dsv4flash_recipes` (folder `recipes/` mapped by setup.py) and Hydra
reads it as `pkg://dsv4flash_recipes`; from a source checkout that predates the mapping it is read
straight from `<repo>/recipes`.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from dsv4flash.train.schema import TrainConfig, check_known_keys, register_schemas

RECIPES_PACKAGE = "dsv4flash_recipes"
PRIMARY = "config"


def recipes_dir() -> Path | None:
    """The recipes folder of a source checkout, if this is one."""
    candidate = Path(__file__).resolve().parents[2] / "recipes"
    return candidate if (candidate / f"{PRIMARY}.yaml").is_file() else None


def config_path() -> str:
    """Hydra `config_path` of the recipe tree: `pkg://dsv4flash_recipes` when installed, else the source folder."""
    spec = importlib.util.find_spec(RECIPES_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / f"{PRIMARY}.yaml").is_file():
                return f"pkg://{RECIPES_PACKAGE}"
    local = recipes_dir()
    if local is None:
        raise RuntimeError(f"cannot find the recipe tree: package {RECIPES_PACKAGE!r} is not installed with its "
                           "YAML files and there is no recipes/ folder next to the dsv4flash sources")
    return str(local)


def available_recipes() -> list[str]:
    """Names of the files in `recipe/` (what `+recipe=` accepts)."""
    path = config_path()
    if path.startswith("pkg://"):
        from importlib.resources import files

        folder = files(RECIPES_PACKAGE) / "recipe"
        names = [p.name for p in folder.iterdir()]
    else:
        names = [p.name for p in (Path(path) / "recipe").iterdir()]
    return sorted(n[: -len(".yaml")] for n in names if n.endswith(".yaml"))


def compose(recipe: str | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the primary config plus `+recipe=<recipe>` and overrides, exactly as the command line would."""
    from hydra import compose as hydra_compose

    register_schemas()
    args = ([f"+recipe={recipe}"] if recipe else []) + list(overrides)
    with isolated_hydra(config_path()):
        return hydra_compose(config_name=PRIMARY, overrides=args)


@contextmanager
def isolated_hydra(path: str) -> Iterator[None]:
    """Initialise Hydra on `path` (`pkg://module` or a folder) for a composition, even inside a running
    Hydra app (building the base before a fine-tuning run, the veRL config of an engine=verl run): the app's
    global Hydra is set aside and put back afterwards."""
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    outer = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        if path.startswith("pkg://"):
            ctx = initialize_config_module(config_module=path[len("pkg://"):], version_base=None)
        else:
            ctx = initialize_config_dir(config_dir=path, version_base=None)
        with ctx:
            yield
    finally:
        restore_gh_from_backup(outer)


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The typed run config (dataclasses all the way down), interpolations resolved; unknown keys are errors."""
    check_known_keys(cfg, TrainConfig)
    return OmegaConf.to_object(cfg)
