"""`import_adapter_dir`: an adapter on disk (a `python -m dsv4flash.train` output or an adapter directory in any
layout `dsv4flash lifecycle export` writes) as a new revision of a policy, through `AdapterStore.publish`.

The directory must say what it is: its `dsv4flash_adapter.json` section gives the placement (which the server
needs to rebuild the adapter's model shell) and, with `base_model_name_or_path`, the base; the tensors are
checked against that placement on a meta model before anything is written. The revision forks from the base
(no parent: nothing says it was trained from the policy's head), becomes the head and is tagged `latest`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["import_adapter_dir", "policy_name_for"]

_NOT_TAG = re.compile(r"[^A-Za-z0-9_.\-]+")


def _run_record(source: Path) -> dict[str, Any]:
    """`revision.json` of a training output (recipe, step, base hash; `source` is the output or its adapter/),
    or {} for a bare adapter directory."""
    path = next((p for p in (source / "revision.json", source.parent / "revision.json")
                 if p.is_file() and (p.parent == source or source.name == "adapter")), None)
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (a training run's revision record)")
    return data


def policy_name_for(source: str | os.PathLike) -> str:
    """The default policy of an import: a training output's recipe, else the directory's name (made a valid name)."""
    source = Path(source).resolve()
    recipe = _run_record(source).get("recipe")
    name = _NOT_TAG.sub("-", str(recipe or source.name)).strip("-.") or "imported"
    return name[:128]


def import_adapter_dir(store, source: str | os.PathLike, *, policy: str | None = None):
    """Publish the adapter at `source` as `policy`'s new head (default `policy_name_for(source)`) -> the revision."""
    from dsv4flash.lifecycle.catalog.base import LATEST
    from dsv4flash.lifecycle.errors import AdapterFormatError
    from dsv4flash.lifecycle.export import adapter_source, check_against_base, read_adapter_dir, recorded_base_config
    from dsv4flash.lifecycle.fingerprint import base_fingerprint
    from dsv4flash.lifecycle.packed import PackedMoELoRA
    from dsv4flash.lora.peft_io import SECTION_NAME

    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: not a directory (expected a training output or an adapter directory)")
    directory = adapter_source(source)
    data, canonical = read_adapter_dir(source)
    section = data.get("dsv4flash") or {}
    if not section.get("lora_config"):
        raise AdapterFormatError(f"{directory / SECTION_NAME}: missing or without a lora_config, so the placement "
                                 "is unknown (write the directory with dsv4flash: a training run, save_peft_adapter or "
                                 "`dsv4flash lifecycle export`)")
    cfg = recorded_base_config(data)
    if cfg is None:
        raise AdapterFormatError(f"{directory / 'adapter_config.json'}: names no base dsv4flash can load "
                                 f"(base_model_name_or_path {data.get('base_model_name_or_path')!r}, "
                                 f"{SECTION_NAME} base {section.get('base')!r})")
    check_against_base(data, canonical, str(directory))
    run = _run_record(source)
    policy = policy or policy_name_for(source)
    adapter = PackedMoELoRA.from_packed_tensors(canonical, alpha=float(data["lora_alpha"]), source=str(directory))
    store.create_policy(policy, base_fingerprint(cfg), {"engine": "import", "source": str(directory.resolve()),
                                                       "placement": dict(section["lora_config"])})
    step = run.get("step")
    return store.publish(policy, adapter, parent=None, step=int(step) if step is not None else None,
                         data_position={"step": int(step)} if step is not None else None, tags=[LATEST],
                         extra={"engine": "import", "placement": dict(section["lora_config"]),
                                "source": str(directory.resolve()), "recipe": run.get("recipe"),
                                "base_weights_sha256": run.get("parent_base_sha256")})
