"""The one interface of a content-addressed blob store, and the factory that picks its backend from a store location.

A backend keeps immutable blobs at their sha256 address and guarantees the publish protocol's first half: a blob
is either absent or complete at its address (never half-written), a repeated put of the same bytes is a no-op that
refreshes the blob's age (so gc's grace period protects it), and whatever a killed writer leaves behind (temp files,
unfinished uploads: "temp items") is told apart from a live writer's where the backend can tell, and swept.
Two backends implement it: the filesystem (`blobstore.BlobStore`, temp file + rename) and S3
(`s3_blobstore.S3BlobStore`, spool + one atomic PUT or multipart-upload completion); `store.open_blobs` picks one
from a store location. Callers never branch on which one they hold.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from dsv4flash.lifecycle.errors import IntegrityError
from dsv4flash.lifecycle.faults import crashpoint

__all__ = ["BlobBackend", "BlobInfo", "BlobSink", "ByteSource", "HashingWriter", "check_key"]

_HEX = frozenset("0123456789abcdef")
_CHUNK = 16 << 20


def check_key(key: str) -> str:
    """`key` if it is a 64-hex sha256, else ValueError naming it."""
    if len(key) != 64 or not set(key) <= _HEX:
        raise ValueError(f"blob key {key!r} is not a 64-hex sha256")
    return key


@dataclass(frozen=True)
class BlobInfo:
    """A stored blob: its content address, size and modification time."""

    key: str
    size: int
    mtime: float


class ByteSource(Protocol):
    """Random-access reads of one stored blob (a file descriptor, or ranged GETs of an object)."""

    name: str  # what error messages call it (a path, an s3:// URL)
    size: int

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset`."""

    def readinto_at(self, view: memoryview, offset: int) -> None:
        """Fill `view` with the bytes at `offset` (error on a short read)."""

    def close(self) -> None:
        """Release the descriptor / connection."""


class BlobSink(Protocol):
    """A write-once blob in the making: `write` bytes, then `commit()` -> its key (or `abort()`)."""

    key: str | None

    def write(self, data) -> int:
        """Append bytes (any buffer)."""

    def commit(self) -> str:
        """Make the blob visible at its content address; returns the hex key."""

    def abort(self) -> None:
        """Drop what was written; nothing becomes visible."""

    def __enter__(self) -> "BlobSink": ...

    def __exit__(self, exc_type, exc, tb) -> None: ...


class HashingWriter:
    """What every backend's sink shares: bytes appended to a local file (`_file`) and folded into a sha256 as they
    come, with the crash points the fault tests arm; a backend adds `commit` (to the content address) and `abort`."""

    def __init__(self, file, expected_size: int | None = None) -> None:
        self._file = file
        self._hash = hashlib.sha256()
        self._written = 0
        self._half = (expected_size or 0) // 2
        self._crossed_half = False
        self.key: str | None = None
        crashpoint("blob.open")

    def write(self, data) -> int:
        """Append bytes (any buffer) and fold them into the hash."""
        view = memoryview(data).cast("B")
        self._file.write(view)
        self._hash.update(view)
        self._written += len(view)
        if not self._crossed_half and self._half and self._written >= self._half:
            self._crossed_half = True
            self._file.flush()  # so a crash here really leaves a half-written file behind
            crashpoint("blob.mid_write")
        return len(view)

    def abort(self) -> None:  # pragma: no cover - every backend defines it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or self.key is None:
            self.abort()


class BlobBackend(ABC):
    """Immutable blobs addressed by sha256; see the module docstring for the guarantees."""

    root: Any  # where the blobs live (a Path, an s3:// URL string), for messages
    swept_on_open: int  # dead writers' temp items removed when this store was opened

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the blob is stored."""

    @abstractmethod
    def writer(self, expected_size: int | None = None) -> BlobSink:
        """A new writer; call `commit()` to publish it."""

    @abstractmethod
    def source(self, key: str) -> ByteSource:
        """Random-access reader of blob `key` (FileNotFoundError if absent); close it after use."""

    @abstractmethod
    def delete(self, key: str) -> int:
        """Remove a blob; returns the bytes freed (0 if it was absent)."""

    @abstractmethod
    def iter_blobs(self) -> Iterator[BlobInfo]:
        """Every stored blob."""

    @abstractmethod
    def temp_states(self) -> list[tuple[Any, str]]:
        """Each temp item with "live" (its writer still runs), "dead" (its writer is gone) or "unknown"."""

    @abstractmethod
    def temp_age(self, item: Any) -> float:
        """Seconds since a temp item was started (FileNotFoundError if it went meanwhile)."""

    @abstractmethod
    def remove_temp(self, item: Any) -> None:
        """Remove one temp item (already gone is fine)."""

    @abstractmethod
    def default_catalog(self) -> str | None:
        """The catalog of the store these blobs belong to when none is named (None: the store was never created)."""

    @abstractmethod
    def remember_catalog(self, catalog: str) -> None:
        """Make `catalog` the store's default from now on, where the backend records one (creating the store)."""

    def describe(self, key: str) -> str:
        """Where blob `key` lives, for messages."""
        return f"{self.root}/{check_key(key)[:2]}/{key}"

    # ---- built on the primitives above ----
    def put_bytes(self, data: bytes) -> str:
        """Store bytes and return their key."""
        with self.writer(len(data)) as w:
            w.write(data)
            return w.commit()

    def put_stream(self, produce: Callable[[BlobSink], None], expected_size: int | None = None) -> str:
        """Store whatever `produce(writer)` writes and return the key."""
        with self.writer(expected_size) as w:
            produce(w)
            return w.commit()

    def read_bytes(self, key: str, verify: bool = True) -> bytes:
        """The whole blob, checked against its address unless `verify=False`."""
        src = self.source(key)
        try:
            data = src.pread(src.size, 0)
        finally:
            src.close()
        if verify and hashlib.sha256(data).hexdigest() != key:
            raise IntegrityError(f"blob {self.describe(key)} does not hash to its address {key}")
        return data

    def verify(self, key: str) -> None:
        """Raise `IntegrityError` if the stored bytes no longer hash to `key`."""
        h = hashlib.sha256()
        src = self.source(key)
        try:
            for offset in range(0, src.size, _CHUNK):
                h.update(src.pread(min(_CHUNK, src.size - offset), offset))
        finally:
            src.close()
        if h.hexdigest() != key:
            raise IntegrityError(f"blob {self.describe(key)} hashes to {h.hexdigest()}, not its address {key}")

    def temp_items(self) -> list[Any]:
        """Every temp item, whatever its writer's state."""
        return [item for item, _ in self.temp_states()]

    def dead_temp_files(self) -> list[Any]:
        """Temp items whose writer is gone (known for certain: a released lock, a dead process on this host)."""
        return [item for item, state in self.temp_states() if state == "dead"]

    def stale_temp_files(self, older_than_s: float) -> list[Any]:
        """Temp items no live writer holds: dead writers' at once, where liveness cannot tell, after `older_than_s`."""
        found = []
        for item, state in self.temp_states():
            try:
                if state == "dead" or (state == "unknown" and self.temp_age(item) > older_than_s):
                    found.append(item)
            except FileNotFoundError:  # committed or swept meanwhile
                pass
        return found

    def sweep_dead_temp_files(self) -> int:
        """Remove what killed writers left (done whenever a store is opened); returns the count."""
        dead = self.dead_temp_files()
        for item in dead:
            self.remove_temp(item)
        return len(dead)

