"""MinT-style adapter lifecycle, storage side: revisions, policy records, catalog, cache tiers.

Two objects (docs/lifecycle.md):
  * `AdapterRevision` — immutable, content-addressed bytes: LoRA weights + layout manifest (format,
    rank, alpha, targets, expert geometry, base fingerprint, parent, policy). Id = sha256 of the file.
  * `PolicyRecord` — mutable service state: head revision (and its parent), tags, trainer state of
    the head (optimizer/RNG blob, scheduler position, data position), rollout records, eval scores.
Around them: `AdapterStore` (blob store + catalog; atomic publish, load, gc), `Catalog` backends
(SQLite by default, PostgreSQL for multi-node), `AdapterCache` (disk → CPU → device slots with
accounting, prefetch, pipelined cold loads and a QUEUED state under slot pressure), the packed MoE
LoRA format with PEFT/vLLM exports, and `save_checkpoint`/`resume` for bit-exact training resume.
Names are imported lazily so `import dsv4flash.lifecycle` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AdapterRevision": "dsv4flash.lifecycle.revision",
    "LayoutManifest": "dsv4flash.lifecycle.revision",
    "read_revision_file": "dsv4flash.lifecycle.revision",
    "PolicyRecord": "dsv4flash.lifecycle.catalog.base",
    "RevisionRecord": "dsv4flash.lifecycle.catalog.base",
    "StateRecord": "dsv4flash.lifecycle.catalog.base",
    "Catalog": "dsv4flash.lifecycle.catalog.base",
    "open_catalog": "dsv4flash.lifecycle.catalog",
    "AdapterStore": "dsv4flash.lifecycle.store",
    "BaseFingerprint": "dsv4flash.lifecycle.fingerprint",
    "base_fingerprint": "dsv4flash.lifecycle.fingerprint",
    "fingerprint_from_parts": "dsv4flash.lifecycle.fingerprint",
    "census_rows_from_state_dict": "dsv4flash.lifecycle.fingerprint",
    "PackedMoELoRA": "dsv4flash.lifecycle.packed",
    "export_peft": "dsv4flash.lifecycle.export",
    "import_peft": "dsv4flash.lifecycle.export",
    "export_vllm_3d": "dsv4flash.lifecycle.export",
    "import_vllm_3d": "dsv4flash.lifecycle.export",
    "AdapterCache": "dsv4flash.lifecycle.tiers",
    "Lease": "dsv4flash.lifecycle.tiers",
    "LeaseState": "dsv4flash.lifecycle.tiers",
    "SlotPool": "dsv4flash.lifecycle.slots",
    "ExactSlots": "dsv4flash.lifecycle.slots",
    "CpuCache": "dsv4flash.lifecycle.cpu_cache",
    "LoadAccount": "dsv4flash.lifecycle.loader",
    "save_checkpoint": "dsv4flash.lifecycle.checkpoint",
    "resume": "dsv4flash.lifecycle.checkpoint",
    "DataCursor": "dsv4flash.lifecycle.trainer_state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dsv4flash.lifecycle' has no attribute {name!r}")
