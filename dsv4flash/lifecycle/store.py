"""AdapterStore: blob store + catalog = the service plane's durable half.

`publish` is the only way bytes become a revision, in this order:
  1. the revision file (weights + manifest) is written to a temp file, fsynced, and renamed onto its
     content address (blob store); the optional trainer-state blob likewise;
  2. one catalog transaction registers the revision row, its trainer state, the head move (compare-and-
     set against the parent the trainer started from) and any tags.
A crash before 2 commits leaves only unreferenced blobs (invisible; `gc` removes them); a crash after
leaves the complete new revision. Readers therefore see the old or the new head, never a partial one.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from dsv4flash.lifecycle.blobstore import BlobStore
from dsv4flash.lifecycle.catalog import (ANY_HEAD, Catalog, PolicyRecord, RevisionRecord, StateRecord, is_database_url,
                                         open_catalog)
from dsv4flash.lifecycle.errors import CatalogUnreadableError, LifecycleError, StoreNotFoundError
from dsv4flash.lifecycle.fingerprint import BaseFingerprint
from dsv4flash.lifecycle.loader import LoadedRevision, read_revision_blob
from dsv4flash.lifecycle.packed import PackedMoELoRA
from dsv4flash.lifecycle.revision import AdapterRevision, LayoutManifest, decode_adapter, encode_revision, revision_tensors
from dsv4flash.lifecycle.safetensors_io import iter_payload

__all__ = ["AdapterStore", "GCReport"]

_UNSET: Any = object()  # "no expectation given" (None is a real head value: the policy has no revision yet)


@dataclass
class GCReport:
    """What a garbage collection removed (or would remove, with `dry_run`)."""

    blobs_deleted: int
    bytes_freed: int
    temp_files_deleted: int
    blobs_kept: int
    dry_run: bool


class AdapterStore:
    """Publish, resolve and load adapter revisions and policy records under one root directory."""

    def __init__(self, root: str | os.PathLike, catalog: Catalog | str | os.PathLike | None = None):
        self.root = Path(root)
        self.blobs = BlobStore(self.root / "blobs")
        if catalog is None:
            catalog = self.root / "catalog.sqlite"
        self.catalog = catalog if isinstance(catalog, Catalog) else open_catalog(catalog)

    @classmethod
    def open(cls, root: str | os.PathLike, catalog: str | os.PathLike | None = None, *,
             create: bool = False) -> "AdapterStore":
        """Open the store at `root`; unless `create`, a missing root or default catalog is an error, not a new store."""
        root = Path(root)
        default = catalog is None
        path = root / "catalog.sqlite" if default else None
        if not default and not is_database_url(os.fspath(catalog)):
            path = Path(os.fspath(catalog).removeprefix("sqlite:///"))
        if not create:
            if not root.is_dir():
                raise StoreNotFoundError(f"{root}: no adapter store here (create one with "
                                         f"`dsv4flash lifecycle --root {root} init`)")
            if path is not None and not path.is_file():
                raise StoreNotFoundError(f"{path}: no catalog; {root} is not an adapter store (create one with "
                                         f"`dsv4flash lifecycle --root {root} init`)")
        try:
            return cls(root, catalog)
        except (sqlite3.DatabaseError, OSError) as exc:
            raise CatalogUnreadableError(f"{path or catalog}: cannot open the catalog ({exc})") from None
        except Exception as exc:
            if type(exc).__module__.startswith("psycopg"):
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CatalogUnreadableError(f"{catalog}: cannot open the catalog ({first})") from None
            raise

    # ---- policies ----
    def create_policy(self, name: str, base: BaseFingerprint, meta: Mapping[str, Any] | None = None) -> PolicyRecord:
        """Create (or reopen) a policy on a base."""
        return self.catalog.create_policy(name, base, meta)

    def policy(self, name: str) -> PolicyRecord:
        """Current policy record."""
        return self.catalog.policy(name)

    # ---- publish ----
    def publish(
        self,
        policy: str,
        payload: PackedMoELoRA | Mapping[str, torch.Tensor],
        *,
        parent: str | None = "head",
        step: int | None = None,
        trainer_state: bytes | None = None,
        scheduler: Mapping[str, Any] | None = None,
        data_position: Mapping[str, Any] | None = None,
        tags: Iterable[str] = (),
        expect_head: Any = _UNSET,
        extra: Mapping[str, Any] | None = None,
    ) -> AdapterRevision:
        """Atomically publish adapter bytes (+ optional trainer state) as the policy's new head.

        `parent="head"` (default) chains onto the current head and refuses to move the head if another
        writer moved it meanwhile (`HeadConflictError`) — including the very first publish, which
        expects no head; pass an explicit id to fork, or `None` for a root. `expect_head` overrides the
        expectation (`ANY_HEAD` to move the head unconditionally).
        """
        prec = self.catalog.policy(policy)
        if parent == "head":
            parent = prec.head
            if expect_head is _UNSET:
                expect_head = prec.head  # compare-and-set: fail if another writer moved the head meanwhile
        elif parent is not None:
            parent = self.catalog.resolve(parent).id
        if expect_head is _UNSET:
            expect_head = ANY_HEAD
        tensors, fields = revision_tensors(payload)
        manifest = LayoutManifest(policy=policy, base=prec.base, parent=parent, step=step, extra=dict(extra or {}), **fields)
        key, size = self._write_revision(tensors, manifest)
        state_key = self.blobs.put_bytes(trainer_state) if trainer_state is not None else None
        record = RevisionRecord(key, policy, parent, prec.base.digest, manifest.format, size, len(tensors), step, time.time())
        state = None
        if trainer_state is not None or scheduler or data_position:
            state = StateRecord(policy, key, step, state_key, dict(scheduler or {}), dict(data_position or {}))
        self.catalog.register(record, state=state, expect_head=expect_head, tags=tags)
        # A concurrent gc may have collected a deduplicated blob between its liveness scan and our
        # commit; the revision is registered now, so rewrite the bytes if that happened.
        if not self.blobs.exists(key):
            self._write_revision(tensors, manifest)
        if state_key is not None and not self.blobs.exists(state_key):
            self.blobs.put_bytes(trainer_state)
        return AdapterRevision(key, manifest, size, len(tensors))

    def _write_revision(self, tensors: Mapping[str, torch.Tensor], manifest: LayoutManifest) -> tuple[str, int]:
        head, order, size = encode_revision(tensors, manifest)

        def produce(w) -> None:
            w.write(head)
            for chunk in iter_payload(tensors, order):
                w.write(chunk)

        return self.blobs.put_stream(produce, expected_size=size), size

    # ---- read ----
    def resolve(self, ref: str) -> RevisionRecord:
        """Revision row by id, prefix, `policy` or `policy:tag`."""
        return self.catalog.resolve(ref)

    def load(self, ref: str, *, resident_base: BaseFingerprint | None = None, verify: bool = True, pin_memory: bool = False) -> LoadedRevision:
        """Read a revision's tensors from disk (hash-verified; base-checked when `resident_base` is given)."""
        rec = self.catalog.resolve(ref)
        if not self.blobs.exists(rec.id):
            raise LifecycleError(f"revision {rec.id[:12]} of policy {rec.policy!r} is registered but its bytes are missing from {self.blobs.root}"
                                 + (" (it was retired and collected)" if rec.retired else ""))
        return read_revision_blob(self.blobs, rec.id, verify=verify, pin_memory=pin_memory, resident_base=resident_base)

    def load_adapter(self, ref: str, *, resident_base: BaseFingerprint | None = None) -> PackedMoELoRA | dict[str, torch.Tensor]:
        """A revision decoded: `PackedMoELoRA` for packed revisions, else the flat tensor dict."""
        loaded = self.load(ref, resident_base=resident_base)
        return decode_adapter(loaded.tensors, loaded.manifest, source=f"revision {loaded.id[:12]}")

    def trainer_state(self, policy: str, ref: str) -> tuple[StateRecord | None, bytes | None]:
        """The trainer state saved with a revision: its catalog row and the state blob's bytes."""
        rec = self.catalog.resolve(ref)
        state = self.catalog.state(policy, rec.id)
        if state is None or state.state_blob is None:
            return state, None
        return state, self.blobs.read_bytes(state.state_blob)

    # ---- retention ----
    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False) -> GCReport:
        """Delete blobs no live revision or trainer state references (older than `grace_s`)."""
        cutoff = time.time() - grace_s
        live = self.catalog.live_blob_keys()
        deleted = freed = kept = 0
        for blob in self.blobs.iter_blobs():
            if blob.key in live or blob.mtime >= cutoff:
                kept += 1
                continue
            deleted += 1
            freed += blob.size if dry_run else self.blobs.delete(blob.key)
        temps = self.blobs.stale_temp_files(grace_s)  # never a live writer's; a dead one's whatever its age
        if not dry_run:
            for p in temps:
                p.unlink(missing_ok=True)
        return GCReport(deleted, freed, len(temps), kept, dry_run)

    def close(self) -> None:
        """Close the catalog connection."""
        self.catalog.close()

    def __enter__(self) -> "AdapterStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
