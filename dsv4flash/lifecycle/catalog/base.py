"""The catalog's storage interface and its records; backends (SQLite, PostgreSQL) implement `Catalog`.

The catalog holds *names and pointers*, never tensor bytes: revision rows (content id, lineage, base,
size), policy records (head, tags, per-revision trainer state, rollouts, evaluation scores) and the tag
log. Every mutating call is one transaction, so a reader sees either the state before or after it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from dsv4flash.lifecycle.fingerprint import BaseFingerprint

__all__ = ["Catalog", "RevisionRecord", "StateRecord", "PolicyRecord", "TagMove", "ANY_HEAD", "HEAD", "LATEST"]

HEAD = "head"  # the reserved tag name for a policy's head pointer
LATEST = "latest"  # the tag every training run's publish (and `dsv4flash lifecycle import`) moves to its new revision


class _AnyHead:
    def __repr__(self) -> str:
        return "ANY_HEAD"


ANY_HEAD: Any = _AnyHead()  # `expect_head=ANY_HEAD`: move the head whatever it points at


@dataclass(frozen=True)
class RevisionRecord:
    """A catalog row for one adapter revision (the bytes are blob `id` in the blob store)."""

    id: str
    policy: str
    parent: str | None
    base: str  # base fingerprint digest
    format: str
    nbytes: int
    n_tensors: int
    step: int | None = None
    created: float = 0.0
    retired: bool = False
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StateRecord:
    """Trainer state saved with a revision: optimizer/RNG blob, scheduler and data position."""

    policy: str
    revision: str
    step: int | None
    state_blob: str | None  # blob key of the serialized optimizer + RNG state
    scheduler: Mapping[str, Any] = field(default_factory=dict)
    data_position: Mapping[str, Any] = field(default_factory=dict)
    created: float = 0.0


@dataclass(frozen=True)
class TagMove:
    """One entry of the tag log: `tag` moved from `previous` to `revision` at `at`."""

    seq: int
    policy: str
    tag: str
    revision: str
    previous: str | None
    at: float
    reason: str


@dataclass
class PolicyRecord:
    """Mutable service state of one policy, as of the moment it was read."""

    name: str
    base: BaseFingerprint
    head: str | None
    head_parent: str | None
    tags: dict[str, str]
    state: StateRecord | None  # trainer state saved with the head revision
    evals: dict[str, float]  # evaluation scores of the head revision
    rollout_count: int
    created: float
    updated: float
    meta: dict[str, Any]


class Catalog(abc.ABC):
    """Storage interface of the adapter catalog."""

    url: str

    # ---- policies ----
    @abc.abstractmethod
    def create_policy(self, name: str, base: BaseFingerprint, meta: Mapping[str, Any] | None = None, *, exist_ok: bool = True) -> PolicyRecord:
        """Create a policy on a base (or return it if it exists on the same base and `exist_ok`)."""

    @abc.abstractmethod
    def policy(self, name: str) -> PolicyRecord:
        """The current policy record (raises `PolicyNotFoundError`)."""

    @abc.abstractmethod
    def list_policies(self, *, after: str | None = None, limit: int | None = None, offset: int = 0,
                      newest_first: bool = False) -> list[str]:
        """Policy names in name order: all, or (keyset paging) at most `limit` of those after `after`; with
        `newest_first`, the most recently updated first (ties by name, descending), `limit` of them after the first
        `offset` (an index keeps either order's page at the cost of its own rows)."""

    @abc.abstractmethod
    def count_policies(self) -> int:
        """Number of policies."""

    # ---- revisions ----
    @abc.abstractmethod
    def register(
        self,
        rev: RevisionRecord,
        *,
        state: StateRecord | None = None,
        expect_head: Any = ANY_HEAD,
        move_head: bool = True,
        tags: Iterable[str] = (),
    ) -> RevisionRecord:
        """Atomically add a revision (idempotent), its trainer state, head move and tags."""

    @abc.abstractmethod
    def bulk_register(self, revs: Iterable[RevisionRecord], *, batch: int = 10_000, move_heads: bool = True) -> int:
        """Insert many revisions in large transactions (imports, benchmarks); returns rows added."""

    @abc.abstractmethod
    def lookup(self, rev_id: str) -> RevisionRecord:
        """A revision by full id (raises `RevisionNotFoundError`)."""

    @abc.abstractmethod
    def resolve(self, ref: str) -> RevisionRecord:
        """A revision by id, unique id prefix (≥ 6 hex), `policy`, `policy:head` or `policy:<tag>`."""

    @abc.abstractmethod
    def ancestors(self, rev_id: str, limit: int | None = None) -> list[RevisionRecord]:
        """Parent, grandparent, … up to the root (nearest first)."""

    @abc.abstractmethod
    def children(self, rev_id: str) -> list[RevisionRecord]:
        """Revisions whose parent is `rev_id`, oldest first."""

    @abc.abstractmethod
    def revisions(self, policy: str, *, limit: int = 100, include_retired: bool = False) -> list[RevisionRecord]:
        """A policy's revisions, newest first."""

    @abc.abstractmethod
    def count(self) -> int:
        """Number of registered revisions."""

    # ---- tags ----
    @abc.abstractmethod
    def tag(self, policy: str, tag: str, ref: str, *, reason: str = "tag") -> RevisionRecord:
        """Point `policy:tag` at a revision (moving `head` is `tag(policy, "head", …)`)."""

    @abc.abstractmethod
    def untag(self, policy: str, tag: str, *, reason: str = "untag") -> str:
        """Remove `policy:tag` (never `head`); returns the revision it pointed at. The removal is logged."""

    @abc.abstractmethod
    def tags(self, policy: str) -> dict[str, str]:
        """Tag name -> revision id (without `head`)."""

    @abc.abstractmethod
    def list_tagged(self, prefixes: Iterable[str], *, limit: int | None = None,
                    offset: int = 0) -> list[tuple[str, str, RevisionRecord]]:
        """(policy, tag, revision) of every policy's tags that start with one of `prefixes`, the newest revision
        first (ties by policy, then tag, descending): `limit` of them after the first `offset`."""

    @abc.abstractmethod
    def count_tagged(self, prefixes: Iterable[str]) -> int:
        """Number of tags, over every policy, that start with one of `prefixes`."""

    @abc.abstractmethod
    def tag_history(self, policy: str, tag: str = HEAD) -> list[TagMove]:
        """Every move of a tag, oldest first."""

    @abc.abstractmethod
    def rollback(self, policy: str, tag: str = HEAD, to: str | None = None) -> RevisionRecord:
        """Point a tag (default the head) at an earlier revision: `to`, or the current one's parent."""

    # ---- service state ----
    @abc.abstractmethod
    def state(self, policy: str, rev_id: str) -> StateRecord | None:
        """Trainer state saved with a revision, if any."""

    @abc.abstractmethod
    def add_rollouts(self, policy: str, rev_id: str, records: Iterable[Mapping[str, Any]]) -> int:
        """Append rollout records (JSON objects) produced by a revision."""

    @abc.abstractmethod
    def rollouts(self, policy: str, rev_id: str | None = None, *, limit: int = 1000) -> list[dict[str, Any]]:
        """Rollout records, oldest first."""

    @abc.abstractmethod
    def record_eval(self, policy: str, rev_id: str, metric: str, value: float, step: int | None = None) -> None:
        """Set an evaluation score of a revision."""

    @abc.abstractmethod
    def evals(self, policy: str, rev_id: str) -> dict[str, float]:
        """Evaluation scores of a revision."""

    # ---- retention ----
    @abc.abstractmethod
    def retire(self, rev_id: str) -> None:
        """Mark a revision's bytes collectable (refused while a head or tag points at it)."""

    @abc.abstractmethod
    def live_blob_keys(self) -> set[str]:
        """Blob keys still referenced: live revisions and their trainer-state blobs."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection."""

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
