"""Embedded SQLite catalog (the default): one file, WAL journal, safe across processes on one host."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from dsv4flash.lifecycle.catalog.sql import SQLCatalog

__all__ = ["SQLiteCatalog"]


class SQLiteCatalog(SQLCatalog):
    """Catalog in a SQLite file.

    WAL lets readers proceed while one writer commits; `BEGIN IMMEDIATE` takes the write lock up front
    so two writers never deadlock upgrading a read lock; `busy_timeout` plus the retry loop absorb
    contention. `synchronous=NORMAL` (default) is atomic and survives process crashes (kill -9); use
    `FULL` to also survive power loss. Do not put the file on NFS: use the PostgreSQL catalog for
    catalogs shared between hosts.
    """

    def __init__(self, path: str | os.PathLike, *, synchronous: str = "NORMAL", busy_timeout_ms: int = 60_000, cache_mb: int = 64):
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF/NORMAL/FULL/EXTRA, got {synchronous!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.url = f"sqlite:///{self.path}"
        self._synchronous = synchronous.upper()
        self._busy_timeout_ms = busy_timeout_ms
        self._cache_mb = cache_mb
        super().__init__()

    def _check_file(self) -> None:
        """Refuse a main file shorter than its own header says (a truncated copy reads as missing rows, not an error)."""
        try:
            with open(self.path, "rb") as fh:
                header = fh.read(100)
            size = self.path.stat().st_size
        except FileNotFoundError:
            return  # a new catalog
        if len(header) < 100:
            if size:
                raise sqlite3.DatabaseError(f"file is not a database ({size} bytes, shorter than the SQLite header)")
            return
        if header[:16] != b"SQLite format 3\x00":
            raise sqlite3.DatabaseError("file is not a database")
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(header[28:32], "big")
        valid = header[24:28] == header[92:96]  # the in-header size is trusted only when its counter matches
        if valid and pages * page_size > size:
            raise sqlite3.DatabaseError(f"database disk image is truncated: the header records {pages} pages of "
                                        f"{page_size} bytes, the file has {size} bytes")

    def _connect(self) -> sqlite3.Connection:
        self._check_file()
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=self._busy_timeout_ms / 1000)
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"{self.path}: SQLite refused WAL mode (got {mode!r}); is the file on a network filesystem?")
        conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        # Page cache per connection: at 10^6 revisions the id/parent indexes are ~300 MB, and random
        # content ids touch them everywhere; a bigger cache keeps lookups and inserts off the disk.
        conn.execute(f"PRAGMA cache_size = {-1024 * int(self._cache_mb)}")
        return conn

    def _is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and any(w in str(exc).lower() for w in ("locked", "busy"))

    def integrity_check(self) -> str:
        """SQLite's own structural check ("ok" when healthy)."""
        with self._lock:
            return self._conn.execute("PRAGMA integrity_check").fetchone()[0]
