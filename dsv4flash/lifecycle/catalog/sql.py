"""The catalog over SQL: one implementation, two dialects (SQLite embedded, PostgreSQL shared).

Concurrency model: every mutation is one explicit write transaction that first locks the policy row
(SQLite: `BEGIN IMMEDIATE` takes the database write lock; PostgreSQL: `SELECT … FOR UPDATE`), so
writers in any number of processes serialise per policy and a crashed writer leaves nothing behind.
Busy/serialisation failures are retried with backoff. Reads run in their own short transaction, so a
policy record is read from one snapshot.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from dsv4flash.lifecycle.catalog.base import ANY_HEAD, HEAD, Catalog, PolicyRecord, RevisionRecord, StateRecord
from dsv4flash.lifecycle.catalog.schema import DDL, R_REV_COLS, REV_COLS, SCHEMA_VERSION, TAG, dumps, page_clause
from dsv4flash.lifecycle.catalog.sql_state import ServiceStateSQL
from dsv4flash.lifecycle.errors import (
    BaseMismatchError,
    HeadConflictError,
    LifecycleError,
    PolicyNotFoundError,
    RevisionNotFoundError,
)
from dsv4flash.lifecycle.faults import crashpoint
from dsv4flash.lifecycle.fingerprint import BaseFingerprint
from dsv4flash.lifecycle.refs import REVISION_PATTERN, split_catalog_ref

__all__ = ["SQLCatalog", "SCHEMA_VERSION"]

_HEX = REVISION_PATTERN



class SQLCatalog(ServiceStateSQL, Catalog):
    """Dialect-neutral catalog; subclasses provide the connection and the dialect bits."""

    placeholder = "?"
    types = {"REAL": "REAL", "BIGINT": "INTEGER", "SERIAL": "INTEGER PRIMARY KEY AUTOINCREMENT"}
    for_update = ""
    begin_write = "BEGIN IMMEDIATE"
    begin_read = "BEGIN"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._conn = self._connect()
        self._ensure_schema()

    # ---- dialect hooks ----
    def _connect(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _is_transient(self, exc: BaseException) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def _schema_lock(self, cur) -> None:
        """Serialise concurrent schema creation (PostgreSQL needs an advisory lock)."""

    # ---- transactions ----
    def _sql(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    def _run(self, fn: Callable[[Any], Any], *, write: bool, crash_points: bool = False, single: bool = False,
             retries: int = 200) -> Any:
        """Run `fn(cursor)` in one transaction (retrying busy/serialisation failures).

        `single=True` marks a read of exactly one statement: it runs without BEGIN/COMMIT (a single
        statement is its own snapshot), saving two round trips on PostgreSQL.
        """
        explicit = write or not single
        delay = 0.002
        for attempt in range(retries):
            with self._lock:
                cur = self._conn.cursor()
                try:
                    if explicit:
                        cur.execute(self.begin_write if write else self.begin_read)
                    result = fn(cur)
                    if crash_points:
                        crashpoint("catalog.before_commit")
                    if explicit:
                        cur.execute("COMMIT")
                except BaseException as exc:
                    try:
                        if explicit:
                            cur.execute("ROLLBACK")
                    except Exception:  # noqa: BLE001 - the transaction may already be gone
                        pass
                    if isinstance(exc, Exception) and self._is_transient(exc) and attempt + 1 < retries:
                        time.sleep(delay * (1 + random.random()))
                        delay = min(delay * 2, 0.25)
                        continue
                    raise
                finally:
                    cur.close()
            if crash_points:
                crashpoint("catalog.after_commit")
            return result
        raise LifecycleError(f"catalog {self.url}: gave up after {retries} busy retries")  # pragma: no cover

    def _x(self, cur, sql: str, params: Iterable[Any] = ()) -> Any:
        cur.execute(self._sql(sql), tuple(params))
        return cur

    def _ensure_schema(self) -> None:
        def create(cur):
            self._schema_lock(cur)
            for stmt in DDL.format(**self.types).split(";"):
                if stmt.strip():
                    cur.execute(stmt)
            row = self._x(cur, "SELECT value FROM catalog_meta WHERE key = ?", ("schema_version",)).fetchone()
            if row is None:
                self._x(cur, "INSERT INTO catalog_meta (key, value) VALUES (?, ?)", ("schema_version", str(SCHEMA_VERSION)))
            elif int(row[0]) != SCHEMA_VERSION:
                raise LifecycleError(f"catalog {self.url} has schema version {row[0]}, this dsv4flash reads {SCHEMA_VERSION}")

        self._run(create, write=True)

    # ---- row helpers ----
    @staticmethod
    def _rev(row) -> RevisionRecord:
        return RevisionRecord(row[0], row[1], row[2], row[3], row[4], int(row[5]), int(row[6]),
                              None if row[7] is None else int(row[7]), float(row[8]), bool(row[9]), json.loads(row[10]))

    def _rev_or_none(self, cur, rev_id: str) -> RevisionRecord | None:
        row = self._x(cur, f"SELECT {REV_COLS} FROM revisions WHERE id = ?", (rev_id,)).fetchone()
        return self._rev(row) if row else None

    def _policy_row(self, cur, name: str, *, lock: bool):
        row = self._x(cur, "SELECT name, base, base_summary, head, created, updated, meta FROM policies WHERE name = ?"
                      + (self.for_update if lock else ""), (name,)).fetchone()
        if row is None:
            raise PolicyNotFoundError(f"no policy named {name!r} in catalog {self.url}")
        return row

    def _log(self, cur, policy: str, tag: str, revision: str, previous: str | None, reason: str) -> None:
        self._x(cur, "INSERT INTO tag_log (policy, tag, revision, previous, at, reason) VALUES (?, ?, ?, ?, ?, ?)",
                (policy, tag, revision, previous, time.time(), reason))

    def _point(self, cur, policy: str, tag: str, rev: RevisionRecord, reason: str) -> None:
        prow = self._policy_row(cur, policy, lock=True)
        if rev.base != prow[1]:
            raise BaseMismatchError(f"revision {rev.id[:12]} (base {rev.base[:19]}…) cannot be {policy}:{tag}: the policy's base is {prow[1][:19]}…")
        if rev.retired:
            raise LifecycleError(f"revision {rev.id[:12]} is retired (its bytes may be collected); it cannot become {policy}:{tag}")
        now = time.time()
        if tag == HEAD:
            previous = prow[3]
            self._x(cur, "UPDATE policies SET head = ?, updated = ? WHERE name = ?", (rev.id, now, policy))
        else:
            old = self._x(cur, "SELECT revision FROM tags WHERE policy = ? AND tag = ?", (policy, tag)).fetchone()
            previous = old[0] if old else None
            self._x(cur, "INSERT INTO tags (policy, tag, revision, updated) VALUES (?, ?, ?, ?) "
                         "ON CONFLICT (policy, tag) DO UPDATE SET revision = excluded.revision, updated = excluded.updated",
                    (policy, tag, rev.id, now))
            self._x(cur, "UPDATE policies SET updated = ? WHERE name = ?", (now, policy))
        self._log(cur, policy, tag, rev.id, previous, reason)

    # ---- policies ----
    def create_policy(self, name: str, base: BaseFingerprint, meta: Mapping[str, Any] | None = None, *, exist_ok: bool = True) -> PolicyRecord:
        """Create a policy on a base (or return it if it exists on the same base and `exist_ok`)."""
        if not TAG.fullmatch(name):
            raise ValueError(f"policy name {name!r}: use letters, digits, '_', '-', '.' (max 128)")

        def create(cur):
            row = self._x(cur, "SELECT base FROM policies WHERE name = ?", (name,)).fetchone()
            if row is not None:
                if not exist_ok:
                    raise LifecycleError(f"policy {name!r} already exists in {self.url}")
                if row[0] != base.digest:
                    raise BaseMismatchError(f"policy {name!r} exists on base {row[0][:19]}…, not {base}")
                return
            now = time.time()
            self._x(cur, "INSERT INTO policies (name, base, base_summary, head, created, updated, meta) VALUES (?, ?, ?, NULL, ?, ?, ?) "
                         "ON CONFLICT (name) DO NOTHING", (name, base.digest, base.summary, now, now, dumps(meta)))

        self._run(create, write=True)
        return self.policy(name)

    def policy(self, name: str) -> PolicyRecord:
        """The current policy record (raises `PolicyNotFoundError`)."""
        def read(cur):
            p = self._policy_row(cur, name, lock=False)
            head = p[3]
            tags = dict(self._x(cur, "SELECT tag, revision FROM tags WHERE policy = ? ORDER BY tag", (name,)).fetchall())
            head_parent = state = None
            evals: dict[str, float] = {}
            if head is not None:
                head_rev = self._rev_or_none(cur, head)
                head_parent = head_rev.parent if head_rev else None
                state = self._state(cur, name, head)
                evals = self._evals(cur, name, head)
            count = self._x(cur, "SELECT COUNT(*) FROM rollouts WHERE policy = ?", (name,)).fetchone()[0]
            return PolicyRecord(p[0], BaseFingerprint(p[1], p[2]), head, head_parent, tags, state, evals, int(count),
                                float(p[4]), float(p[5]), json.loads(p[6]))

        return self._run(read, write=False)

    def list_policies(self, *, after: str | None = None, limit: int | None = None, offset: int = 0,
                      newest_first: bool = False) -> list[str]:
        """Policy names in name order: all, or (keyset paging) at most `limit` of those after `after`; with
        `newest_first`, the most recently updated first (ties by name, descending), `limit` of them after the first
        `offset` (an index keeps either order's page at the cost of its own rows)."""
        where, params = ("WHERE name > ? ", [after]) if after is not None else ("", [])
        order = "updated DESC, name DESC" if newest_first else "name"
        sql = f"SELECT name FROM policies {where}ORDER BY {order}" + page_clause(params, limit, offset)
        return self._run(lambda cur: [r[0] for r in self._x(cur, sql, params).fetchall()], write=False, single=True)

    def count_policies(self) -> int:
        """Number of policies."""
        return int(self._run(lambda cur: self._x(cur, "SELECT COUNT(*) FROM policies").fetchone()[0], write=False,
                             single=True))

    # ---- revisions ----
    def register(self, rev: RevisionRecord, *, state: StateRecord | None = None, expect_head: Any = ANY_HEAD,
                 move_head: bool = True, tags: Iterable[str] = ()) -> RevisionRecord:
        """Atomically add a revision (idempotent), its trainer state, head move and tags."""
        tags = list(tags)
        for t in tags:
            if t == HEAD or not TAG.fullmatch(t):
                raise ValueError(f"tag {t!r}: reserved or malformed (letters, digits, '_', '-', '.')")

        def reg(cur):
            prow = self._policy_row(cur, rev.policy, lock=True)
            if rev.base != prow[1]:
                raise BaseMismatchError(f"revision {rev.id[:12]} was built on base {rev.base[:19]}… but policy {rev.policy!r} is on {prow[1][:19]}… ({prow[2]})")
            if expect_head is not ANY_HEAD and prow[3] != expect_head:
                raise HeadConflictError(f"policy {rev.policy!r}: expected head {str(expect_head)[:12]}, found {str(prow[3])[:12]} (another writer published first)")
            if rev.parent is not None and self._rev_or_none(cur, rev.parent) is None:
                raise RevisionNotFoundError(f"parent revision {rev.parent} of {rev.id[:12]} is not registered")
            existing = self._rev_or_none(cur, rev.id)
            if existing is None:
                self._x(cur, f"INSERT INTO revisions ({REV_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                        (rev.id, rev.policy, rev.parent, rev.base, rev.format, rev.nbytes, rev.n_tensors, rev.step,
                         rev.created or time.time(), dumps(rev.meta)))
            elif existing.retired:
                self._x(cur, "UPDATE revisions SET retired = 0 WHERE id = ?", (rev.id,))
            if state is not None:
                self._x(cur, "INSERT INTO states (policy, revision, step, state_blob, scheduler, data_position, created) VALUES (?, ?, ?, ?, ?, ?, ?) "
                             "ON CONFLICT (policy, revision) DO UPDATE SET step = excluded.step, state_blob = excluded.state_blob, "
                             "scheduler = excluded.scheduler, data_position = excluded.data_position, created = excluded.created",
                        (state.policy, state.revision, state.step, state.state_blob, dumps(state.scheduler), dumps(state.data_position), time.time()))
            record = self._rev_or_none(cur, rev.id)
            if move_head and prow[3] != rev.id:
                self._point(cur, rev.policy, HEAD, record, "publish")
            for t in tags:
                self._point(cur, rev.policy, t, record, "publish")
            return record

        return self._run(reg, write=True, crash_points=True)

    def bulk_register(self, revs: Iterable[RevisionRecord], *, batch: int = 10_000, move_heads: bool = True) -> int:
        """Insert many revisions in large transactions (imports, benchmarks); returns rows added."""
        added = 0
        last: dict[str, str] = {}
        rows: list[tuple] = []
        sql = f"INSERT INTO revisions ({REV_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?) ON CONFLICT (id) DO NOTHING"

        def flush(cur):
            cur.executemany(self._sql(sql), rows)
            return len(rows)

        for rev in revs:
            rows.append((rev.id, rev.policy, rev.parent, rev.base, rev.format, rev.nbytes, rev.n_tensors, rev.step,
                         rev.created or time.time(), dumps(rev.meta)))
            last[rev.policy] = rev.id
            if len(rows) >= batch:
                added += self._run(flush, write=True)
                rows = []
        if rows:
            added += self._run(flush, write=True)
        if move_heads and last:
            def heads(cur):
                cur.executemany(self._sql("UPDATE policies SET head = ?, updated = ? WHERE name = ?"),
                                [(rid, time.time(), pol) for pol, rid in last.items()])
            self._run(heads, write=True)
        return added

    def lookup(self, rev_id: str) -> RevisionRecord:
        """A revision by full id (raises `RevisionNotFoundError`)."""
        rev = self._run(lambda cur: self._rev_or_none(cur, rev_id), write=False, single=True)
        if rev is None:
            raise RevisionNotFoundError(f"no revision {rev_id} in catalog {self.url}")
        return rev

    def resolve(self, ref: str) -> RevisionRecord:
        """A revision by id, unique id prefix (≥ 6 hex), `policy`, `policy:head` or `policy:<tag>`."""
        return self._run(lambda cur: self._resolve(cur, ref), write=False, single=bool(_HEX.fullmatch(ref)) and len(ref) == 64)

    def _resolve(self, cur, ref: str) -> RevisionRecord:
        if _HEX.fullmatch(ref):
            rows = self._x(cur, f"SELECT {REV_COLS} FROM revisions WHERE id >= ? AND id < ? ORDER BY id LIMIT 2",
                           (ref, ref + "g")).fetchall()
            if len(rows) == 1:
                return self._rev(rows[0])
            if len(rows) > 1:
                raise RevisionNotFoundError(f"revision prefix {ref!r} is ambiguous in {self.url}; give more hex digits")
        policy, tag = split_catalog_ref(ref)
        tag = tag or HEAD
        prow = self._x(cur, "SELECT head FROM policies WHERE name = ?", (policy,)).fetchone()
        if prow is None:
            raise RevisionNotFoundError(f"{ref!r} is neither a revision id/prefix nor a policy in {self.url}")
        if tag == HEAD:
            target = prow[0]
        else:
            trow = self._x(cur, "SELECT revision FROM tags WHERE policy = ? AND tag = ?", (policy, tag)).fetchone()
            target = trow[0] if trow else None
        rev = self._rev_or_none(cur, target) if target is not None else None
        if rev is None:
            raise RevisionNotFoundError(f"policy {policy!r} has no {tag!r} revision yet")
        return rev

    def ancestors(self, rev_id: str, limit: int | None = None) -> list[RevisionRecord]:
        """Parent, grandparent, … up to the root (nearest first)."""
        sql = ("WITH RECURSIVE chain (id, parent, depth) AS ("
               " SELECT id, parent, 0 FROM revisions WHERE id = ?"
               " UNION ALL SELECT r.id, r.parent, c.depth + 1 FROM revisions r JOIN chain c ON r.id = c.parent WHERE c.depth < ?)"
               f" SELECT {R_REV_COLS} FROM chain c JOIN revisions r ON r.id = c.id WHERE c.depth > 0 ORDER BY c.depth")
        self.lookup(rev_id)
        return self._run(lambda cur: [self._rev(r) for r in self._x(cur, sql, (rev_id, limit or 2**62)).fetchall()], write=False)

    def children(self, rev_id: str) -> list[RevisionRecord]:
        """Revisions whose parent is `rev_id`, oldest first."""
        return self._run(lambda cur: [self._rev(r) for r in self._x(
            cur, f"SELECT {REV_COLS} FROM revisions WHERE parent = ? ORDER BY created, id", (rev_id,)).fetchall()], write=False, single=True)

    def revisions(self, policy: str, *, limit: int = 100, include_retired: bool = False) -> list[RevisionRecord]:
        """A policy's revisions, newest first."""
        where = "" if include_retired else " AND retired = 0"
        return self._run(lambda cur: [self._rev(r) for r in self._x(
            cur, f"SELECT {REV_COLS} FROM revisions WHERE policy = ?{where} ORDER BY created DESC, id LIMIT ?", (policy, limit)).fetchall()], write=False, single=True)

    def count(self) -> int:
        """Number of registered revisions."""
        return int(self._run(lambda cur: self._x(cur, "SELECT COUNT(*) FROM revisions").fetchone()[0], write=False, single=True))

    def close(self) -> None:
        """Release the connection."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
