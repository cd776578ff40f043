"""Atomic publish: a writer SIGKILLed at every step of a publish leaves the old head or the new one.

Each case arms one crash point (`dsv4flash.lifecycle.faults.POINTS`) in a child process that publishes
revision 2 on top of revision 1, then checks from a fresh connection that
  * the head is revision 1 (killed before commit) or the complete revision 2 (killed after commit),
  * every registered revision's bytes exist and hash to their id (nothing partial is visible),
  * gc removes the debris (orphan blobs, temp files) and a retried publish gives the same id.
"""

from __future__ import annotations

import os
import signal

import pytest

from dsv4flash.lifecycle.catalog import open_catalog
from dsv4flash.lifecycle.faults import POINTS
from dsv4flash.lifecycle.store import AdapterStore

PUBLISH_POINTS = [p for p in POINTS if not p.startswith("export.")]
COMMITTED = {"catalog.after_commit"}


def _publish(store: AdapterStore, adapter, step: int):
    return store.publish("pol", adapter, step=step, trainer_state=b"optimizer-state-%d" % step * 500,
                         scheduler={"last_epoch": step}, data_position={"index": step}, tags=["candidate"])


@pytest.fixture()
def seeded(tmp_path, catalog_url, base_fp, adapter_factory):
    """A store with policy `pol` at revision 1, plus the adapter for revision 2 built before any fork."""
    store = AdapterStore(tmp_path / "store", open_catalog(catalog_url))
    store.create_policy("pol", base_fp)
    rev1 = _publish(store, adapter_factory(0), 1)
    adapter2 = adapter_factory(1, hidden=64, moe_inter=48)  # large enough that "mid write" is mid-file
    return store, catalog_url, rev1, adapter2


def _assert_consistent(store: AdapterStore) -> None:
    for rec in store.catalog.revisions("pol", include_retired=True, limit=100):
        store.blobs.verify(rec.id)
        state = store.catalog.state("pol", rec.id)
        if state and state.state_blob:
            store.blobs.verify(state.state_blob)
    if hasattr(store.catalog, "integrity_check"):
        assert store.catalog.integrity_check() == "ok"


@pytest.mark.parametrize("point", PUBLISH_POINTS)
def test_publish_killed_at(point, seeded, fork, tmp_path):
    store, url, rev1, adapter2 = seeded
    root = store.root

    def child():
        _publish(AdapterStore(root, open_catalog(url)), adapter2, 2)

    status = fork(child, crash_at=point)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child was not killed at {point} (status {status})"

    fresh = AdapterStore(root, open_catalog(url))
    head = fresh.policy("pol")
    _assert_consistent(fresh)
    if point in COMMITTED:
        assert head.head != rev1.id and head.head_parent == rev1.id
        assert fresh.load_adapter("pol:head").equal(adapter2)
        assert head.tags["candidate"] == head.head and head.state.data_position == {"index": 2}
        assert fresh.trainer_state("pol", head.head)[1] == b"optimizer-state-2" * 500
    else:
        assert head.head == rev1.id and head.tags["candidate"] == rev1.id and head.state.step == 1
        assert fresh.catalog.count() == 1
    # gc with no grace removes whatever the dead writer left; live bytes stay
    live_before = fresh.catalog.live_blob_keys()
    fresh.gc(grace_s=0)
    assert {b.key for b in fresh.blobs.iter_blobs()} == live_before
    assert not list(fresh.blobs.tmp_dir.iterdir())
    _assert_consistent(fresh)
    # a retry after the crash publishes the same content-addressed revision a clean run would
    if point not in COMMITTED:
        rev2 = _publish(fresh, adapter2, 2)
        clean = AdapterStore(tmp_path / "clean", str(tmp_path / "clean.sqlite"))
        clean.create_policy("pol", fresh.policy("pol").base)
        _publish(clean, seeded[0].load_adapter(rev1.id), 1)
        assert _publish(clean, adapter2, 2).id == rev2.id
        assert fresh.load_adapter("pol").equal(adapter2)


def test_kill_mid_write_leaves_a_temp_file_the_next_open_removes(seeded, fork):
    store, url, rev1, adapter2 = seeded

    def child():
        _publish(AdapterStore(store.root, open_catalog(url)), adapter2, 2)

    fork(child, crash_at="blob.mid_write")
    parts = list(store.blobs.tmp_dir.glob("*.part"))
    assert len(parts) == 1 and 0 < parts[0].stat().st_size  # the half-written file exists …
    assert store.blobs.dead_temp_files() == parts  # … its writer's lock died with it …
    assert store.gc(grace_s=3600).temp_files_deleted == 1  # … so gc takes it inside the grace period
    fork(child, crash_at="blob.mid_write")
    reopened = AdapterStore(store.root, open_catalog(url))  # and so does merely opening the store
    assert reopened.blobs.swept_on_open == 1 and not list(store.blobs.tmp_dir.iterdir())
    assert store.policy("pol").head == rev1.id


def test_a_live_writers_temp_file_is_never_swept(seeded):
    store, url, rev1, adapter2 = seeded
    with store.blobs.writer() as w:
        w.write(b"x" * 1000)
        assert AdapterStore(store.root, open_catalog(url)).blobs.swept_on_open == 0
        assert store.gc(grace_s=0).temp_files_deleted == 0  # not even with no grace
        assert store.blobs.dead_temp_files() == []
        key = w.commit()
    assert store.blobs.read_bytes(key) == b"x" * 1000


def test_crash_in_fresh_interpreter(seeded, run_py):
    """The same guarantee with a real `python` process SIGKILLed inside the catalog transaction."""
    store, url, rev1, _ = seeded
    code = (
        "from dsv4flash.lifecycle.store import AdapterStore\n"
        "from dsv4flash.lifecycle.catalog import open_catalog\n"
        "from dsv4flash.lifecycle.packed import PackedMoELoRA\n"
        f"st = AdapterStore({str(store.root)!r}, open_catalog({url!r}))\n"
        "ad = PackedMoELoRA.random(layers=[0], num_experts=4, hidden=8, moe_inter=6, rank=2, seed=7)\n"
        "st.publish('pol', ad, step=3)\n"
        "print('PUBLISHED')\n"
    )
    proc = run_py(code, env={"DSV4FLASH_CRASH_AT": "catalog.before_commit"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "PUBLISHED" not in proc.stdout
    fresh = AdapterStore(store.root, open_catalog(url))
    assert fresh.policy("pol").head == rev1.id and fresh.catalog.count() == 1
    assert len(list(fresh.blobs.iter_blobs())) == 3  # rev1 + its state + the orphan of the dead publish
    assert fresh.gc(grace_s=0).blobs_deleted == 1
