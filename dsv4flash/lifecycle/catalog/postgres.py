"""PostgreSQL catalog: one catalog shared by trainers and samplers on several nodes.

Uses psycopg 3 (`pip install "psycopg[binary]"`, imported lazily). The blob store must then be a path
all nodes see (a shared filesystem); the catalog only holds names and pointers. Writers lock the
policy row (`SELECT … FOR UPDATE`) inside an explicit transaction, so concurrent publishers to one
policy serialise and publishers to different policies proceed in parallel.
"""

from __future__ import annotations

from dsv4flash.lifecycle.catalog.sql import SQLCatalog

__all__ = ["PostgresCatalog"]


class PostgresCatalog(SQLCatalog):
    """Catalog in a PostgreSQL database given by a libpq URL/DSN."""

    placeholder = "%s"
    types = {"REAL": "DOUBLE PRECISION", "BIGINT": "BIGINT", "SERIAL": "BIGSERIAL PRIMARY KEY"}
    for_update = " FOR UPDATE"
    begin_write = "BEGIN"
    begin_read = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"

    def __init__(self, dsn: str, *, connect_timeout: int = 30):
        self.dsn = dsn
        self.url = _redact(dsn)
        self._connect_timeout = connect_timeout
        super().__init__()

    def _connect(self):
        try:
            import psycopg  # noqa: PLC0415 - optional dependency
        except ImportError as exc:
            raise RuntimeError('the PostgreSQL catalog needs psycopg 3: pip install "psycopg[binary]"') from exc
        self._errors = psycopg.errors
        # autocommit: transactions are explicit BEGIN/COMMIT statements, as for SQLite
        return psycopg.connect(self.dsn, autocommit=True, connect_timeout=self._connect_timeout)

    def _is_transient(self, exc: BaseException) -> bool:
        e = self._errors
        return isinstance(exc, (e.SerializationFailure, e.DeadlockDetected, e.LockNotAvailable))

    def _schema_lock(self, cur) -> None:
        # CREATE TABLE IF NOT EXISTS races on the catalog tables when several processes start at once
        cur.execute("SELECT pg_advisory_xact_lock(4740352161)")


def _redact(dsn: str) -> str:
    """The DSN without its password, for messages."""
    if "://" in dsn and "@" in dsn:
        scheme, rest = dsn.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}@{host}"
    return " ".join(p for p in dsn.split() if not p.startswith("password="))
