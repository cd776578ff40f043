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

from dsv4flash.lifecycle.blob_backend import BlobBackend
from dsv4flash.lifecycle.default_store import is_remote_store, no_store_at, store_location
from dsv4flash.lifecycle.catalog import (ANY_HEAD, Catalog, PolicyRecord, RevisionRecord, StateRecord, is_database_url,
                                         open_catalog)
from dsv4flash.lifecycle.errors import CatalogUnreadableError, LifecycleError, StoreNotFoundError
from dsv4flash.lifecycle.fingerprint import BaseFingerprint
from dsv4flash.lifecycle.loader import LoadedRevision, read_revision_blob
from dsv4flash.lifecycle.packed import PackedMoELoRA
from dsv4flash.lifecycle.revision import AdapterRevision, LayoutManifest, decode_adapter, encode_revision, revision_tensors
from dsv4flash.lifecycle.safetensors_io import iter_payload

__all__ = ["AdapterStore", "GCReport", "open_blobs"]

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
    """Publish, resolve and load adapter revisions and policy records under one store location.

    The location is a directory (blobs/ and, by default, catalog.sqlite in it) or `s3://bucket/prefix` (blobs/
    under that prefix; the catalog is the one recorded when the store was created, usually PostgreSQL). Either way
    the blobs are a `BlobBackend` (dsv4flash/lifecycle/blob_backend.py) and the protocol below is the same.
    """

    def __init__(self, root: str | os.PathLike, catalog: Catalog | str | os.PathLike | None = None):
        self.root = store_location(root)
        self.blobs = open_blobs(self.root)
        if catalog is None:
            catalog = self.blobs.default_catalog()
            if catalog is None:
                raise StoreNotFoundError(_not_a_store(self.root))
        self.catalog = catalog if isinstance(catalog, Catalog) else open_catalog(catalog)

    @classmethod
    def open(cls, root: str | os.PathLike, catalog: str | os.PathLike | None = None, *,
             create: bool = False) -> "AdapterStore":
        """Open the store at `root`; unless `create`, a missing root or default catalog is an error, not a new store.

        Creating an `s3://` store records its catalog (which must then be given) beside its blobs, so later opens
        on any machine need only the URL."""
        root = store_location(root)
        where = catalog  # what a message names: the SQLite file where there is one
        if not is_remote_store(root) and (catalog is None or not is_database_url(os.fspath(catalog))):
            where = root / "catalog.sqlite" if catalog is None else Path(os.fspath(catalog).removeprefix("sqlite:///"))
        try:
            if is_remote_store(root):
                return cls._open_remote(root, catalog, create)
            return cls._open_directory(root, catalog, create)
        except (sqlite3.DatabaseError, OSError) as exc:
            raise CatalogUnreadableError(f"{where or root}: cannot open the catalog ({exc})") from None
        except Exception as exc:
            if type(exc).__module__.startswith("psycopg"):
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CatalogUnreadableError(f"{catalog}: cannot open the catalog ({first})") from None
            raise

    @classmethod
    def _open_directory(cls, root: Path, catalog, create: bool) -> "AdapterStore":
        path = root / "catalog.sqlite" if catalog is None else None
        if catalog is not None and not is_database_url(os.fspath(catalog)):
            path = Path(os.fspath(catalog).removeprefix("sqlite:///"))
        if not create:
            if (missing := no_store_at(root)) is not None:
                raise StoreNotFoundError(missing)
            if path is not None and not path.is_file():
                raise StoreNotFoundError(f"{path}: no catalog; {_not_a_store(root)}")
        return cls(root, catalog)

    @classmethod
    def _open_remote(cls, root: str, catalog, create: bool) -> "AdapterStore":
        blobs = open_blobs(root)
        recorded = blobs.default_catalog()
        if recorded is None and not create:
            raise StoreNotFoundError(_not_a_store(root))
        if catalog is None and recorded is None:
            raise StoreNotFoundError(f"{root}: a new s3:// store needs its catalog named (--catalog postgresql://… for "
                                     "one shared by several machines, or a SQLite path for this one)")
        if recorded is None:
            blobs.remember_catalog(os.fspath(catalog))
        store = cls.__new__(cls)
        store.root, store.blobs = root, blobs
        store.catalog = open_catalog(catalog if catalog is not None else recorded)
        return store

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
        """Read a revision's tensors from the blob store (hash-verified; base-checked when `resident_base` is given)."""
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
            for item in temps:
                self.blobs.remove_temp(item)
        return GCReport(deleted, freed, len(temps), kept, dry_run)

    def close(self) -> None:
        """Close the catalog connection."""
        self.catalog.close()

    def __enter__(self) -> "AdapterStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_blobs(root: str | os.PathLike) -> BlobBackend:
    """The blob backend of a store location: `s3://bucket/prefix` -> S3 under `<prefix>/blobs/`, else `<root>/blobs/`."""
    if is_remote_store(root):
        from dsv4flash.lifecycle.s3_blobstore import S3BlobStore

        return S3BlobStore(f"{os.fspath(root).rstrip('/')}/blobs")
    from dsv4flash.lifecycle.blobstore import BlobStore

    return BlobStore(Path(root) / "blobs")


def _not_a_store(root) -> str:
    return f"{root}: no adapter store here (create one with `dsv4flash lifecycle --root {root} init`)"
