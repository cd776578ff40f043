"""Catalog schema, shared by both SQL dialects (`{REAL}`, `{BIGINT}`, `{SERIAL}` are filled per dialect).

Revision rows are lean (no manifest: that lives in the revision file's header), so 10^6 revisions take
a few hundred MB with their indexes: the primary key on the content id (lookup, prefix resolve), the
parent index (children), and (policy, created) for a policy's history. Policies are indexed by (updated, name)
too, so a newest-first page of 10^6 runs (the Tinker REST listing) reads its own rows.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["DDL", "REV_COLS", "R_REV_COLS", "SCHEMA_VERSION", "TAG", "dumps", "page_clause"]

TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")  # policy and tag names


def dumps(obj: Any) -> str:
    """Canonical JSON of a row's JSON column."""
    return json.dumps(obj if obj is not None else {}, sort_keys=True, separators=(",", ":"))

SCHEMA_VERSION = 1
REV_COLS = "id, policy, parent, base, format, nbytes, n_tensors, step, created, retired, meta"  # a revisions row
R_REV_COLS = ", ".join(f"r.{c.strip()}" for c in REV_COLS.split(","))  # the same, of a query's `revisions r`
_NO_LIMIT = 2**62  # SQLite takes OFFSET only after a LIMIT


def page_clause(params: list, limit: int | None, offset: int) -> str:
    """` LIMIT ? OFFSET ?` of one page (its values appended to `params`), or nothing for all rows."""
    if limit is None and not offset:
        return ""
    if (limit is not None and int(limit) < 0) or int(offset) < 0:
        raise ValueError(f"a catalog page needs limit >= 0 and offset >= 0, got limit={limit}, offset={offset}")
    params += [_NO_LIMIT if limit is None else int(limit), int(offset)]
    return " LIMIT ? OFFSET ?"


DDL = """
CREATE TABLE IF NOT EXISTS catalog_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS policies (
  name TEXT PRIMARY KEY, base TEXT NOT NULL, base_summary TEXT NOT NULL, head TEXT,
  created {REAL} NOT NULL, updated {REAL} NOT NULL, meta TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS revisions (
  id TEXT PRIMARY KEY, policy TEXT NOT NULL, parent TEXT, base TEXT NOT NULL, format TEXT NOT NULL,
  nbytes {BIGINT} NOT NULL, n_tensors {BIGINT} NOT NULL, step {BIGINT}, created {REAL} NOT NULL,
  retired INTEGER NOT NULL DEFAULT 0, meta TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS policies_updated ON policies (updated, name);
CREATE INDEX IF NOT EXISTS revisions_parent ON revisions (parent);
CREATE INDEX IF NOT EXISTS revisions_policy ON revisions (policy, created);
CREATE TABLE IF NOT EXISTS states (
  policy TEXT NOT NULL, revision TEXT NOT NULL, step {BIGINT}, state_blob TEXT, scheduler TEXT NOT NULL,
  data_position TEXT NOT NULL, created {REAL} NOT NULL, PRIMARY KEY (policy, revision));
CREATE TABLE IF NOT EXISTS tags (
  policy TEXT NOT NULL, tag TEXT NOT NULL, revision TEXT NOT NULL, updated {REAL} NOT NULL,
  PRIMARY KEY (policy, tag));
CREATE INDEX IF NOT EXISTS tags_revision ON tags (revision);
CREATE TABLE IF NOT EXISTS tag_log (
  seq {SERIAL}, policy TEXT NOT NULL, tag TEXT NOT NULL, revision TEXT NOT NULL, previous TEXT,
  at {REAL} NOT NULL, reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS tag_log_policy ON tag_log (policy, tag, seq);
CREATE TABLE IF NOT EXISTS rollouts (
  seq {SERIAL}, policy TEXT NOT NULL, revision TEXT NOT NULL, record TEXT NOT NULL, at {REAL} NOT NULL);
CREATE INDEX IF NOT EXISTS rollouts_policy ON rollouts (policy, revision, seq);
CREATE TABLE IF NOT EXISTS evals (
  policy TEXT NOT NULL, revision TEXT NOT NULL, metric TEXT NOT NULL, value {REAL} NOT NULL, step {BIGINT},
  at {REAL} NOT NULL, PRIMARY KEY (policy, revision, metric));
"""
