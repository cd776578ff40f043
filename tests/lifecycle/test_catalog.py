"""Catalog operations on both backends: register/lookup/resolve, lineage, tags, rollback, policy state."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from dsv4flash.lifecycle.catalog import ANY_HEAD, RevisionRecord, StateRecord, open_catalog
from dsv4flash.lifecycle.errors import (
    BaseMismatchError,
    HeadConflictError,
    LifecycleError,
    PolicyNotFoundError,
    ReferencedRevisionError,
    RevisionNotFoundError,
)


def rid(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rev(name: str, policy: str, parent: str | None, base, step: int = 0) -> RevisionRecord:
    return RevisionRecord(rid(name), policy, parent, base.digest, "packed_moe_lora/1", 100 + step, 12, step)


@pytest.fixture()
def cat(catalog_url, base_fp):
    c = open_catalog(catalog_url)
    c.create_policy("pol", base_fp, {"owner": "test"})
    yield c
    c.close()


def test_untag_frees_a_revision_for_retirement(cat, base_fp):
    r0 = cat.register(rev("u0", "pol", None, base_fp, 0), tags=["saved.a"])
    r1 = cat.register(rev("u1", "pol", r0.id, base_fp, 1), tags=["saved.b"])
    with pytest.raises(ReferencedRevisionError, match="pol:saved.a"):
        cat.retire(r0.id)
    assert cat.untag("pol", "saved.a") == r0.id
    assert cat.tags("pol") == {"saved.b": r1.id}
    cat.retire(r0.id)  # nothing points at it any more
    assert r0.id not in cat.live_blob_keys() and r1.id in cat.live_blob_keys()
    assert [(m.revision, m.reason) for m in cat.tag_history("pol", "saved.a")] == [(r0.id, "publish"), (r0.id, "untag")]
    with pytest.raises(RevisionNotFoundError, match="no tag 'saved.a'"):
        cat.untag("pol", "saved.a")
    with pytest.raises(LifecycleError, match="head cannot be removed"):
        cat.untag("pol", "head")
    with pytest.raises(PolicyNotFoundError):
        cat.untag("nopolicy", "x")


def test_register_lookup_resolve(cat, base_fp):
    r1 = cat.register(rev("a", "pol", None, base_fp, 1))
    r2 = cat.register(rev("b", "pol", r1.id, base_fp, 2))
    assert cat.lookup(r1.id).step == 1 and cat.lookup(r2.id).parent == r1.id
    assert cat.resolve(r2.id[:8]).id == r2.id
    assert cat.resolve("pol").id == r2.id == cat.resolve("pol:head").id
    assert cat.count() == 2
    with pytest.raises(RevisionNotFoundError, match="no revision"):
        cat.lookup(rid("missing"))
    with pytest.raises(RevisionNotFoundError, match="neither a revision"):
        cat.resolve("nopolicy")
    with pytest.raises(RevisionNotFoundError, match="no 'prod' revision"):
        cat.resolve("pol:prod")
    # idempotent: the same content id registers once
    again = cat.register(rev("b", "pol", r1.id, base_fp, 2))
    assert again.id == r2.id and cat.count() == 2


def test_ambiguous_prefix(cat, base_fp):
    ids = ["abcdef0" + rid("x")[7:], "abcdef1" + rid("y")[7:]]
    cat.bulk_register(RevisionRecord(i, "pol", None, base_fp.digest, "lora/1", 1, 1) for i in ids)
    with pytest.raises(RevisionNotFoundError, match="ambiguous"):
        cat.resolve("abcdef")
    assert cat.resolve("abcdef1").id == ids[1]


def test_lineage(cat, base_fp):
    root = cat.register(rev("r", "pol", None, base_fp))
    a = cat.register(rev("a", "pol", root.id, base_fp))
    b = cat.register(rev("b", "pol", a.id, base_fp))
    fork = cat.register(rev("f", "pol", a.id, base_fp), move_head=False)
    assert [x.id for x in cat.ancestors(b.id)] == [a.id, root.id]
    assert [x.id for x in cat.ancestors(b.id, limit=1)] == [a.id]
    assert {x.id for x in cat.children(a.id)} == {b.id, fork.id}
    assert cat.children(b.id) == []
    assert cat.policy("pol").head == b.id and cat.policy("pol").head_parent == a.id
    with pytest.raises(RevisionNotFoundError, match="parent revision"):
        cat.register(rev("orphan", "pol", rid("nowhere"), base_fp))


def test_tags_and_rollback(cat, base_fp):
    revs = [cat.register(rev("r0", "pol", None, base_fp, 0))]
    for i in range(1, 4):
        revs.append(cat.register(rev(f"r{i}", "pol", revs[-1].id, base_fp, i), tags=["latest"]))
    cat.tag("pol", "prod", revs[2].id)
    cat.tag("pol", "eval-best", revs[1].id[:10])
    assert cat.tags("pol") == {"latest": revs[3].id, "prod": revs[2].id, "eval-best": revs[1].id}
    # rollback the head one step (its parent), then to an explicit revision
    assert cat.rollback("pol").id == revs[2].id
    assert cat.policy("pol").head == revs[2].id
    assert cat.rollback("pol", to=revs[0].id).id == revs[0].id
    with pytest.raises(LifecycleError, match="nothing earlier"):
        cat.rollback("pol")
    # rollback a tag, leaving head alone
    assert cat.rollback("pol", "prod").id == revs[1].id
    assert cat.policy("pol").tags["prod"] == revs[1].id and cat.policy("pol").head == revs[0].id
    hist = cat.tag_history("pol", "prod")
    assert [(m.revision, m.previous, m.reason) for m in hist] == [(revs[2].id, None, "tag"), (revs[1].id, revs[2].id, "rollback")]
    assert [m.reason for m in cat.tag_history("pol")][-2:] == ["rollback", "rollback"]
    with pytest.raises(ValueError, match="reserved or malformed"):
        cat.register(rev("bad", "pol", revs[3].id, base_fp), tags=["head"])
    # rollbacks never edit revisions
    assert cat.lookup(revs[3].id) == revs[3]


def test_head_compare_and_set(cat, base_fp):
    r1 = cat.register(rev("a", "pol", None, base_fp), expect_head=None)
    with pytest.raises(HeadConflictError, match="another writer"):
        cat.register(rev("b", "pol", None, base_fp), expect_head=None)
    assert cat.count() == 1  # the failed publish left nothing
    cat.register(rev("b", "pol", r1.id, base_fp), expect_head=r1.id)
    cat.register(rev("c", "pol", r1.id, base_fp), expect_head=ANY_HEAD)
    assert cat.policy("pol").head == rid("c")


def test_base_and_policy_checks(cat, base_fp, other_fp):
    with pytest.raises(BaseMismatchError, match="policy 'pol' is on"):
        cat.register(rev("x", "pol", None, other_fp))
    with pytest.raises(PolicyNotFoundError, match="no policy named 'ghost'"):
        cat.register(rev("x", "ghost", None, base_fp))
    with pytest.raises(BaseMismatchError, match="exists on base"):
        cat.create_policy("pol", other_fp)
    with pytest.raises(LifecycleError, match="already exists"):
        cat.create_policy("pol", base_fp, exist_ok=False)
    with pytest.raises(ValueError, match="policy name"):
        cat.create_policy("bad name!", base_fp)
    cat.create_policy("other", other_fp)
    r = cat.register(rev("o", "other", None, other_fp))
    with pytest.raises(BaseMismatchError):
        cat.tag("pol", "prod", r.id)
    assert cat.list_policies() == ["other", "pol"]
    assert cat.list_policies(limit=1) == ["other"]  # keyset pages, as /v1/models reads them
    assert cat.list_policies(after="other", limit=5) == ["pol"] and cat.list_policies(after="pol") == []
    assert cat.list_policies(after="a") == ["other", "pol"]  # a cursor need not be a name


def test_newest_first_pages_and_tag_listings(cat, base_fp):
    """Runs newest first and tags across policies newest revision first, paged by limit/offset in the database."""
    for i, name in enumerate(["p1", "p2", "p3"]):
        cat.create_policy(name, base_fp)
        cat.register(replace(rev(f"{name}-a", name, None, base_fp), created=100.0 + i), tags=["weights.a", "other"])
        cat.register(replace(rev(f"{name}-b", name, None, base_fp), created=200.0 - i), tags=["sampler_weights.b"])
    order = cat.list_policies(newest_first=True)
    assert order[:3] == ["p3", "p2", "p1"] and order[3] == "pol" and cat.count_policies() == 4  # pol: never updated since
    assert cat.list_policies(newest_first=True, limit=2, offset=1) == ["p2", "p1"]
    assert cat.list_policies(newest_first=True, offset=3) == ["pol"] and cat.list_policies(limit=0) == []
    kinds = ("weights.", "sampler_weights.")
    rows = cat.list_tagged(kinds)
    assert [(p, t) for p, t, _ in rows] == [("p1", "sampler_weights.b"), ("p2", "sampler_weights.b"),
                                            ("p3", "sampler_weights.b"), ("p3", "weights.a"), ("p2", "weights.a"),
                                            ("p1", "weights.a")]
    assert rows[0][2].id == rid("p1-b") and rows[0][2].created == 200.0 and cat.count_tagged(kinds) == 6
    assert cat.list_tagged(kinds, limit=2, offset=3) == rows[3:5] and cat.count_tagged(["other"]) == 3
    assert cat.list_tagged(["weights_"]) == []  # a prefix is literal: '_' matches no other character
    with pytest.raises(ValueError, match="offset"):
        cat.list_policies(newest_first=True, offset=-1)


def test_policy_record_state_rollouts_evals(cat, base_fp):
    r1 = cat.register(rev("a", "pol", None, base_fp, 10),
                      state=StateRecord("pol", rid("a"), 10, rid("state-a"), {"last_epoch": 10}, {"epoch": 1, "index": 7}))
    cat.add_rollouts("pol", r1.id, [{"prompt": i, "reward": i * 0.5} for i in range(5)])
    cat.record_eval("pol", r1.id, "val_loss", 0.25, step=10)
    cat.record_eval("pol", r1.id, "val_loss", 0.24, step=10)  # upsert
    cat.record_eval("pol", r1.id, "accuracy", 0.9)
    p = cat.policy("pol")
    assert p.head == r1.id and p.state.step == 10 and p.state.state_blob == rid("state-a")
    assert p.state.data_position == {"epoch": 1, "index": 7} and p.state.scheduler == {"last_epoch": 10}
    assert p.evals == {"accuracy": 0.9, "val_loss": 0.24} and p.rollout_count == 5
    assert p.meta == {"owner": "test"} and p.base == base_fp
    assert [r["reward"] for r in cat.rollouts("pol", r1.id, limit=3)] == [0.0, 0.5, 1.0]
    with pytest.raises(RevisionNotFoundError):
        cat.add_rollouts("pol", rid("nope"), [{}])
    r2 = cat.register(rev("b", "pol", r1.id, base_fp, 11))
    p = cat.policy("pol")
    assert p.head == r2.id and p.state is None and p.evals == {}  # state/evals are per revision
    assert cat.state("pol", r1.id).step == 10


def test_retire_and_live_keys(cat, base_fp):
    r1 = cat.register(rev("a", "pol", None, base_fp), state=StateRecord("pol", rid("a"), 1, rid("sa")))
    r2 = cat.register(rev("b", "pol", r1.id, base_fp), tags=["prod"])
    assert cat.live_blob_keys() == {r1.id, r2.id, rid("sa")}
    with pytest.raises(ReferencedRevisionError, match="pol:head, pol:prod"):
        cat.retire(r2.id)
    cat.retire(r1.id)
    assert cat.live_blob_keys() == {r2.id}
    assert cat.revisions("pol") == [cat.lookup(r2.id)] and len(cat.revisions("pol", include_retired=True)) == 2
    with pytest.raises(LifecycleError, match="retired"):
        cat.rollback("pol")  # the parent is retired: never point a tag at collectable bytes
    cat.register(rev("a", "pol", None, base_fp), move_head=False)  # re-publishing revives it
    assert not cat.lookup(r1.id).retired


def test_bulk_register_moves_heads(cat, base_fp):
    cat.create_policy("p2", base_fp)
    rows, parent = [], None
    for i in range(250):
        r = rev(f"bulk{i}", "p2", parent, base_fp, i)
        rows.append(r)
        parent = r.id
    assert cat.bulk_register(rows, batch=100) == 250
    assert cat.policy("p2").head == rows[-1].id
    assert len(cat.ancestors(rows[-1].id)) == 249


def test_sqlite_is_wal(tmp_path, base_fp):
    c = open_catalog(f"sqlite:///{tmp_path / 'c.sqlite'}")
    assert c._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert c.integrity_check() == "ok"
