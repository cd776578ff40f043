"""Content-addressed object store on a (possibly shared) filesystem: `objects/<aa>/<sha256>` (a `BlobBackend`).

A blob becomes visible only by `os.replace` of a fully written, fsynced temp file onto its content
address, followed by an fsync of the directory; a crash at any point leaves either no blob or a
complete one, plus at worst the dead writer's `tmp/*.part` file, which the next opening of the store
removes (each live writer holds an flock on its temp file; the kernel drops it when the process dies). The
same bytes always land at the same address, so a repeated publish is a no-op.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Iterator

from dsv4flash.atomic_io import fsync_path
from dsv4flash.lifecycle.blob_backend import BlobBackend, BlobInfo, HashingWriter, check_key
from dsv4flash.lifecycle.errors import IntegrityError
from dsv4flash.lifecycle.faults import crashpoint
from dsv4flash.lifecycle.safetensors_io import FileSource

__all__ = ["BlobStore", "BlobWriter", "BlobInfo", "FileSource", "fsync_dir", "sha256_file"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename/create/unlink in `path` durable."""
    fsync_path(path)


def sha256_file(path: str | os.PathLike, chunk: int = 16 << 20) -> str:
    """Hex sha256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class BlobWriter(HashingWriter):
    """A write-once temp file that hashes as it goes and commits to its content address."""

    def __init__(self, store: "BlobStore", expected_size: int | None = None):
        self._store = store
        name = uuid.uuid4().hex
        # Locked before it gets its `.part` name, so a sweeper never sees an unlocked live temp file; the lock
        # dies with the process (even on SIGKILL), which is how `dead_temp_files` tells a dead writer's file.
        opening = store.tmp_dir / f"{name}.opening"
        file = open(opening, "wb")
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._tmp = store.tmp_dir / f"{name}.part"
        os.replace(opening, self._tmp)
        super().__init__(file, expected_size)

    def commit(self) -> str:
        """fsync, rename to `objects/<aa>/<sha256>` (dedup if present) and return the hex key."""
        crashpoint("blob.before_fsync")
        self._file.flush()
        os.fsync(self._file.fileno())
        key = self._hash.hexdigest()
        final = self._store.path(key)
        crashpoint("blob.before_rename")
        if final.exists() and final.stat().st_size == self._written:
            os.unlink(self._tmp)  # identical content already published
            os.utime(final)  # a fresh mtime keeps gc's grace period from collecting it mid-publish
        else:
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self._tmp, final)  # still open and locked: no sweeper can take it before the rename
            fsync_dir(final.parent)
        self._file.close()
        crashpoint("blob.after_rename")
        self.key = key
        return key

    def abort(self) -> None:
        """Drop the temp file (unlinked while still locked, then closed)."""
        if self.key is None:
            self._tmp.unlink(missing_ok=True)
        if not self._file.closed:
            self._file.close()


class BlobStore(BlobBackend):
    """Immutable blobs addressed by sha256 under one root directory."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.objects = self.root / "objects"
        self.tmp_dir = self.root / "tmp"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.swept_on_open = self.sweep_dead_temp_files()

    def path(self, key: str) -> Path:
        """Where blob `key` lives (whether or not it exists)."""
        return self.objects / check_key(key)[:2] / key

    def describe(self, key: str) -> str:
        """The blob's path, for messages."""
        return str(self.path(key))

    def default_catalog(self) -> str:
        """`catalog.sqlite` beside blobs/ (a directory store's catalog is where its directory is)."""
        return str(self.root.parent / "catalog.sqlite")

    def remember_catalog(self, catalog: str) -> None:
        """Nothing to record: a directory store names a non-default catalog on each open."""

    def exists(self, key: str) -> bool:
        """Whether the blob is stored."""
        return self.path(key).is_file()

    def writer(self, expected_size: int | None = None) -> BlobWriter:
        """A new temp-file writer; call `commit()` to publish it."""
        return BlobWriter(self, expected_size)

    def source(self, key: str) -> FileSource:
        """The blob's file, open for positional reads."""
        return FileSource(self.path(key))

    def read_bytes(self, key: str, verify: bool = True) -> bytes:
        """The whole blob, checked against its address unless `verify=False`."""
        data = self.path(key).read_bytes()
        if verify and hashlib.sha256(data).hexdigest() != key:
            raise IntegrityError(f"blob {self.path(key)} does not hash to its address {key}")
        return data

    def verify(self, key: str) -> None:
        """Raise `IntegrityError` if the stored bytes no longer hash to `key`."""
        actual = sha256_file(self.path(key))
        if actual != key:
            raise IntegrityError(f"blob {self.path(key)} hashes to {actual}, not its address {key}")

    def delete(self, key: str) -> int:
        """Remove a blob; returns the bytes freed (0 if it was absent)."""
        path = self.path(key)
        try:
            size = path.stat().st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return size

    def iter_blobs(self) -> Iterator[BlobInfo]:
        """Every stored blob."""
        for sub in self.objects.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.is_file() and len(entry.name) == 64:
                    st = entry.stat()
                    yield BlobInfo(entry.name, st.st_size, st.st_mtime)

    def temp_age(self, item: Path) -> float:
        """Seconds since the temp file was last written."""
        return time.time() - item.stat().st_mtime

    def remove_temp(self, item: Path) -> None:
        """Unlink a temp file."""
        item.unlink(missing_ok=True)

    def temp_states(self) -> list[tuple[Path, str]]:
        """Each temp file with "live" (its writer holds the lock), "dead" or "unknown" (no locks here)."""
        states = []
        for p in sorted([*self.tmp_dir.glob("*.part"), *self.tmp_dir.glob("*.opening")]):
            if p.suffix == ".opening":  # killed between create and lock+rename: only the age can tell
                states.append((p, "unknown"))
                continue
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                states.append((p, "dead"))
            except BlockingIOError:
                states.append((p, "live"))
            except OSError:  # ENOLCK / EOPNOTSUPP: this filesystem cannot tell
                states.append((p, "unknown"))
            finally:
                os.close(fd)  # releases our probe lock too
        return states
