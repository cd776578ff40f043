"""The project's small base model for the built-in tasks: built by the `pretrain_tiny` recipe, cached by config.

`ensure_base(cfg)` returns the base directory a fine-tuning run loads:

- `model.base=pretrain_tiny`: `<cache>/bases/pretrain_tiny-<key>/model`, where `<key>` hashes the resolved
  pretrain_tiny config (plus `model.base_overrides`) and the sources of the tasks, the engine and the
  reference model; built on first use (under a file lock, so concurrent runs build it once) —
  deterministic for a given config, seed and code;
- `model.base=random`: None (seeded initialisation);
- anything else: a directory written by a previous run (`model/` of a full-model run, or a base dir).
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dsv4flash.engine.fingerprint import MANIFEST, fingerprint
from dsv4flash.train.compose import compose, to_train_config

PRETRAIN_RECIPE = "pretrain_tiny"
BASE_FORMAT = "dsv4flash-base-v2"
# Sources whose behaviour shapes the base: an edit to any of them gives a new cache key (a rebuild).
_KEYED_SOURCES = ("tasks", "engine", "model")


def cache_root(cfg: Any) -> Path:
    """model.cache_dir, else $DSV4FLASH_CACHE, else ~/.cache/dsv4flash."""
    root = cfg.model.cache_dir or os.environ.get("DSV4FLASH_CACHE") or Path.home() / ".cache" / "dsv4flash"
    return Path(root).expanduser()


def pretrain_config(cfg: Any) -> Any:
    """The pretrain_tiny run that produces the base `cfg` asks for (same flavour, plus model.base_overrides)."""
    overrides = [f"model.flavour={cfg.model.flavour}", *cfg.model.base_overrides]
    return to_train_config(compose(PRETRAIN_RECIPE, overrides))


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """sha256 over the task generators, the engine and the reference model sources."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for folder in _KEYED_SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def base_key(pcfg: Any) -> str:
    """Cache key of a pretrain config: its fingerprint (volatile fields dropped), the base format and the
    digest of the code that builds it."""
    return fingerprint(pcfg, BASE_FORMAT + _source_digest())[:16]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_base_dir(cfg: Any, pcfg: Any | None = None) -> Path:
    """Where the base of `cfg` lives in the cache (it may not exist yet)."""
    pcfg = pcfg or pretrain_config(cfg)
    return cache_root(cfg) / "bases" / f"{PRETRAIN_RECIPE}-{base_key(pcfg)}" / "model"


def base_plan(cfg: Any) -> tuple[Path | None, bool]:
    """(the base directory `cfg` loads, whether it must be built first); torch-free, for the run's first line."""
    base = cfg.model.base
    if base == "random":
        return None, False
    if base != PRETRAIN_RECIPE:
        return Path(base).expanduser(), False
    target = cached_base_dir(cfg)
    return target, not (target / MANIFEST).is_file()


def ensure_base(cfg: Any, log=print, progress: Any = None) -> Path | None:
    """The base directory to load for `cfg`, building the pretrain_tiny base when it is missing (`progress`: the
    caller's ProgressLog, so the build shows its steps and lands in the same run log)."""
    base = cfg.model.base
    if base == "random":
        return None
    if base != PRETRAIN_RECIPE:
        path = Path(base).expanduser()
        if not (path / MANIFEST).is_file():
            raise FileNotFoundError(f"model.base={base!r}: no {MANIFEST} there; expected 'pretrain_tiny', 'random' or "
                                    "a base directory written by a full-model run (its model/ folder)")
        return path
    pcfg = pretrain_config(cfg)
    target = cached_base_dir(cfg, pcfg)
    if (target / MANIFEST).is_file():
        return target
    with _locked(target.parent.with_name(target.parent.name + ".lock")):
        if (target / MANIFEST).is_file():  # built by a concurrent run while we waited
            return target
        from dsv4flash.engine.local import run_local

        log(f"base model missing: building it with +recipe={PRETRAIN_RECIPE} ({pcfg.engine.steps} steps) into "
            f"{target.parent} (once; cached for later runs)")
        result = run_local(pcfg, target.parent, log=progress)
        if result.model_dir != target:
            raise RuntimeError(f"pretrain run wrote its model to {result.model_dir}, expected {target}")
    return target


def trained_base(flavour: str = "tiny", log=print) -> Path:
    """The project's trained base of `flavour` (what the main job loads), built and cached like the main job's."""
    return ensure_base(to_train_config(compose(None, [f"model.flavour={flavour}"])), log=log)


def install_base(pcfg: Any, model_dir: Path, root: Path) -> Path:
    """Copy a finished pretrain run's model into the cache slot of its config (no-op when present)."""
    from dsv4flash.engine.model_io import read_manifest

    target = root / "bases" / f"{PRETRAIN_RECIPE}-{base_key(pcfg)}" / "model"
    if (target / MANIFEST).is_file():
        return target
    with _locked(target.parent.with_name(target.parent.name + ".lock")):
        if not (target / MANIFEST).is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(model_dir, tmp)
            read_manifest(tmp)
            os.replace(tmp, target)
    return target
