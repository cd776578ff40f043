"""Identity of runs and bases: the run-config fingerprint of the local engine (resume checks, the base cache
key) and the name of a base directory's manifest; torch-free, so the main job can say whether its base is
cached before it imports the engine."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

MANIFEST = "base.json"  # a base directory's manifest (weights sha256, config fingerprint; engine/model_io.py)

# Fields that do not change what a run computes (left out of the resume/cache fingerprint).
# The device is one too: the dtype (resolved from `auto` before fingerprinting, dsv4flash/engine/local.py) is what
# sets the numerics, so a CPU run keeps the fingerprint it had before the device option existed.
VOLATILE = {("output_dir",), ("engine", "progress"), ("engine", "resume"), ("engine", "threads"), ("engine", "device"),
            ("engine", "log_every"), ("engine", "checkpoint_every"), ("recipe",), ("model", "cache_dir"),
            ("model", "base_overrides"), ("lifecycle",)}


def fingerprint(cfg: Any, extra: str = "") -> str:
    """sha256 of the run config (volatile fields dropped) plus `extra` (e.g. the base's weight hash)."""
    def strip(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            return {k: strip(v, path + (k,)) for k, v in sorted(node.items()) if path + (k,) not in VOLATILE}
        return node

    data = strip(dataclasses.asdict(cfg), ())
    return hashlib.sha256((json.dumps(data, sort_keys=True, default=str) + extra).encode()).hexdigest()
