"""The pointer and service-state half of the SQL catalog: tags, rollback, trainer state, rollouts,
evaluation scores and retention. Mixed into `SQLCatalog`, whose transaction and row helpers it uses.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Mapping

from dsv4flash.lifecycle.catalog.base import HEAD, RevisionRecord, StateRecord, TagMove
from dsv4flash.lifecycle.catalog.schema import R_REV_COLS, TAG, dumps, page_clause
from dsv4flash.lifecycle.errors import LifecycleError, ReferencedRevisionError, RevisionNotFoundError

__all__ = ["ServiceStateSQL"]


class ServiceStateSQL:
    """Tags, rollback, per-revision trainer state, rollouts, evals and retention over SQL."""

    # ---- tags ----
    def tag(self, policy: str, tag: str, ref: str, *, reason: str = "tag") -> RevisionRecord:
        """Point `policy:tag` at a revision (moving `head` is `tag(policy, "head", …)`)."""
        if tag != HEAD and not TAG.fullmatch(tag):
            raise ValueError(f"tag {tag!r}: use letters, digits, '_', '-', '.'")
        def move(cur):
            rev = self._resolve(cur, ref)
            self._point(cur, policy, tag, rev, reason)
            return rev

        return self._run(move, write=True)

    def untag(self, policy: str, tag: str, *, reason: str = "untag") -> str:
        """Remove `policy:tag` (never `head`); returns the revision it pointed at. The removal is logged."""
        if tag == HEAD:
            raise LifecycleError(f"{policy}:head cannot be removed; move it with tag() or rollback()")

        def remove(cur):
            self._policy_row(cur, policy, lock=True)
            row = self._x(cur, "SELECT revision FROM tags WHERE policy = ? AND tag = ?", (policy, tag)).fetchone()
            if row is None:
                raise RevisionNotFoundError(f"policy {policy!r} has no tag {tag!r} in {self.url}")
            self._x(cur, "DELETE FROM tags WHERE policy = ? AND tag = ?", (policy, tag))
            self._x(cur, "UPDATE policies SET updated = ? WHERE name = ?", (time.time(), policy))
            self._log(cur, policy, tag, row[0], row[0], reason)
            return row[0]

        return self._run(remove, write=True)

    def tags(self, policy: str) -> dict[str, str]:
        """Tag name -> revision id (without `head`)."""
        return self.policy(policy).tags

    @staticmethod
    def _prefixed(prefixes: Iterable[str], params: list) -> str:
        """The WHERE condition `tags.tag` starts with one of `prefixes` (their values appended to `params`)."""
        prefixes = list(prefixes)
        if not prefixes:
            raise ValueError("list_tagged / count_tagged: give at least one tag prefix")
        for p in prefixes:
            params += [len(p), p]
        return "(" + " OR ".join(["substr(t.tag, 1, ?) = ?"] * len(prefixes)) + ")"

    def list_tagged(self, prefixes: Iterable[str], *, limit: int | None = None,
                    offset: int = 0) -> list[tuple[str, str, RevisionRecord]]:
        """(policy, tag, revision) of every policy's tags that start with one of `prefixes`, the newest revision
        first (ties by policy, then tag, descending): `limit` of them after the first `offset`."""
        params: list = []
        where = self._prefixed(prefixes, params)
        sql = (f"SELECT t.policy, t.tag, {R_REV_COLS} FROM tags t JOIN revisions r ON r.id = t.revision WHERE {where} "
               f"ORDER BY r.created DESC, t.policy DESC, t.tag DESC" + page_clause(params, limit, offset))
        rows = self._run(lambda cur: self._x(cur, sql, params).fetchall(), write=False, single=True)
        return [(row[0], row[1], self._rev(row[2:])) for row in rows]

    def count_tagged(self, prefixes: Iterable[str]) -> int:
        """Number of tags, over every policy, that start with one of `prefixes`."""
        params: list = []
        where = self._prefixed(prefixes, params)
        return int(self._run(lambda cur: self._x(cur, f"SELECT COUNT(*) FROM tags t WHERE {where}", params)
                             .fetchone()[0], write=False, single=True))

    def tag_history(self, policy: str, tag: str = HEAD) -> list[TagMove]:
        """Every move of a tag, oldest first."""
        rows = self._run(lambda cur: self._x(cur, "SELECT seq, policy, tag, revision, previous, at, reason FROM tag_log "
                                                  "WHERE policy = ? AND tag = ? ORDER BY seq", (policy, tag)).fetchall(), write=False, single=True)
        return [TagMove(int(r[0]), r[1], r[2], r[3], r[4], float(r[5]), r[6]) for r in rows]

    def rollback(self, policy: str, tag: str = HEAD, to: str | None = None) -> RevisionRecord:
        """Point a tag (default the head) at an earlier revision: `to`, or the current one's parent."""
        def rb(cur):
            prow = self._policy_row(cur, policy, lock=True)
            if tag == HEAD:
                current = prow[3]
            else:
                row = self._x(cur, "SELECT revision FROM tags WHERE policy = ? AND tag = ?", (policy, tag)).fetchone()
                current = row[0] if row else None
            if current is None:
                raise RevisionNotFoundError(f"policy {policy!r} has no {tag!r} revision to roll back")
            if to is None:
                cur_rev = self._rev_or_none(cur, current)
                if cur_rev is None or cur_rev.parent is None:
                    raise LifecycleError(f"{policy}:{tag} is at root revision {current[:12]}; there is nothing earlier to roll back to")
                target = self._rev_or_none(cur, cur_rev.parent)
            else:
                target = self._resolve(cur, to)
            self._point(cur, policy, tag, target, "rollback")
            return target

        return self._run(rb, write=True)

    # ---- service state ----
    def _state(self, cur, policy: str, rev_id: str) -> StateRecord | None:
        row = self._x(cur, "SELECT policy, revision, step, state_blob, scheduler, data_position, created FROM states "
                           "WHERE policy = ? AND revision = ?", (policy, rev_id)).fetchone()
        if row is None:
            return None
        return StateRecord(row[0], row[1], None if row[2] is None else int(row[2]), row[3], json.loads(row[4]), json.loads(row[5]), float(row[6]))

    def state(self, policy: str, rev_id: str) -> StateRecord | None:
        """Trainer state saved with a revision, if any."""
        return self._run(lambda cur: self._state(cur, policy, rev_id), write=False, single=True)

    def add_rollouts(self, policy: str, rev_id: str, records: Iterable[Mapping[str, Any]]) -> int:
        """Append rollout records (JSON objects) produced by a revision."""
        now = time.time()
        rows = [(policy, rev_id, dumps(r), now) for r in records]

        def add(cur):
            self._policy_row(cur, policy, lock=True)
            if self._rev_or_none(cur, rev_id) is None:
                raise RevisionNotFoundError(f"rollouts name revision {rev_id}, which is not registered")
            cur.executemany(self._sql("INSERT INTO rollouts (policy, revision, record, at) VALUES (?, ?, ?, ?)"), rows)
            return len(rows)

        return self._run(add, write=True)

    def rollouts(self, policy: str, rev_id: str | None = None, *, limit: int = 1000) -> list[dict[str, Any]]:
        """Rollout records, oldest first."""
        if rev_id is None:
            sql, params = "SELECT record FROM rollouts WHERE policy = ? ORDER BY seq LIMIT ?", (policy, limit)
        else:
            sql, params = "SELECT record FROM rollouts WHERE policy = ? AND revision = ? ORDER BY seq LIMIT ?", (policy, rev_id, limit)
        return [json.loads(r[0]) for r in self._run(lambda cur: self._x(cur, sql, params).fetchall(), write=False, single=True)]

    def record_eval(self, policy: str, rev_id: str, metric: str, value: float, step: int | None = None) -> None:
        """Set an evaluation score of a revision."""
        def rec(cur):
            self._policy_row(cur, policy, lock=True)
            if self._rev_or_none(cur, rev_id) is None:
                raise RevisionNotFoundError(f"eval names revision {rev_id}, which is not registered")
            self._x(cur, "INSERT INTO evals (policy, revision, metric, value, step, at) VALUES (?, ?, ?, ?, ?, ?) "
                         "ON CONFLICT (policy, revision, metric) DO UPDATE SET value = excluded.value, step = excluded.step, at = excluded.at",
                    (policy, rev_id, metric, float(value), step, time.time()))

        self._run(rec, write=True)

    def _evals(self, cur, policy: str, rev_id: str) -> dict[str, float]:
        return {m: float(v) for m, v in self._x(cur, "SELECT metric, value FROM evals WHERE policy = ? AND revision = ? ORDER BY metric",
                                                  (policy, rev_id)).fetchall()}

    def evals(self, policy: str, rev_id: str) -> dict[str, float]:
        """Evaluation scores of a revision."""
        return self._run(lambda cur: self._evals(cur, policy, rev_id), write=False, single=True)

    # ---- retention ----
    def retire(self, rev_id: str) -> None:
        """Mark a revision's bytes collectable (refused while a head or tag points at it)."""
        def ret(cur):
            rev = self._rev_or_none(cur, rev_id)
            if rev is None:
                raise RevisionNotFoundError(f"no revision {rev_id} in catalog {self.url}")
            self._policy_row(cur, rev.policy, lock=True)
            refs = [f"{p}:head" for (p,) in self._x(cur, "SELECT name FROM policies WHERE head = ?", (rev_id,)).fetchall()]
            refs += [f"{p}:{t}" for p, t in self._x(cur, "SELECT policy, tag FROM tags WHERE revision = ?", (rev_id,)).fetchall()]
            if refs:
                raise ReferencedRevisionError(f"revision {rev_id[:12]} is still referenced by {', '.join(sorted(refs))}; move those first")
            self._x(cur, "UPDATE revisions SET retired = 1 WHERE id = ?", (rev_id,))

        self._run(ret, write=True)

    def live_blob_keys(self) -> set[str]:
        """Blob keys still referenced: live revisions and their trainer-state blobs."""
        def live(cur):
            keys = {r[0] for r in self._x(cur, "SELECT id FROM revisions WHERE retired = 0").fetchall()}
            keys |= {r[0] for r in self._x(cur, "SELECT s.state_blob FROM states s JOIN revisions r ON r.id = s.revision "
                                                 "WHERE r.retired = 0 AND s.state_blob IS NOT NULL").fetchall()}
            return keys

        return self._run(live, write=False)
