"""Atomic publish: a writer SIGKILLed at every step of a publish leaves the old head or the new one.

Each case arms one crash point (`dsv4flash.lifecycle.faults.POINTS`) in a child process that publishes
revision 2 on top of revision 1 — into a store on each blob backend (a directory; an S3 bucket on the session's
local S3 server) with each catalog backend — then checks from a fresh connection that
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
def seeded(store_root, catalog_url, base_fp, adapter_factory):
    """A store with policy `pol` at revision 1, plus the adapter for revision 2 built before any fork."""
    store = AdapterStore(store_root, open_catalog(catalog_url))
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
    assert not fresh.blobs.temp_items()
    _assert_consistent(fresh)
    # a retry after the crash publishes the same content-addressed revision a clean run would
    if point not in COMMITTED:
        rev2 = _publish(fresh, adapter2, 2)
        clean = AdapterStore(tmp_path / "clean", str(tmp_path / "clean.sqlite"))
        clean.create_policy("pol", fresh.policy("pol").base)
        _publish(clean, seeded[0].load_adapter(rev1.id), 1)
        assert _publish(clean, adapter2, 2).id == rev2.id
        assert fresh.load_adapter("pol").equal(adapter2)


@pytest.mark.parametrize("store_root", ["dir"], indirect=True)  # an S3 writer's spool is anonymous: see below
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


@pytest.mark.parametrize("store_root", ["dir"], indirect=True)
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


# ---- S3: a multipart upload is the temp file; nothing exists at its address until the upload completes ----
_BIG = 16 << 20  # float32 elements: a 64 MiB revision, eight 8-MiB parts


def _big_revision():
    import torch

    return {"w": torch.arange(_BIG, dtype=torch.float32)}


def _uploads(blobs):
    return blobs.s3.list_multipart_uploads(Bucket=blobs.bucket, Prefix=blobs.objects).get("Uploads", [])


@pytest.mark.parametrize("store_root", ["s3"], indirect=True)
def test_s3_publisher_sigkilled_mid_upload(store_root, tmp_path, base_fp):
    """SIGKILL a real publisher while its parts are going up: nothing is visible at the content address, the next
    publish of the same bytes succeeds beside the stale upload, and the next open aborts that upload."""
    import subprocess
    import sys
    import time

    catalog = str(tmp_path / "catalog.sqlite")
    store = AdapterStore.open(store_root, catalog, create=True)
    store.create_policy("pol", base_fp)
    before = {b.key for b in store.blobs.iter_blobs()}
    code = ("import torch\n"
            "from dsv4flash.lifecycle.store import AdapterStore\n"
            f"AdapterStore.open({store_root!r}).publish('pol', {{'w': torch.arange({_BIG}, dtype=torch.float32)}}, "
            "step=1)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:  # until the first part of its upload has landed
            ups = _uploads(store.blobs)
            if ups and store.blobs.s3.list_parts(Bucket=store.blobs.bucket, Key=ups[0]["Key"],
                                                 UploadId=ups[0]["UploadId"]).get("Parts"):
                break
            assert child.poll() is None, f"the publisher ended before it was killed: {child.stderr.read().decode()}"
            assert time.monotonic() < deadline, "the publisher never started its upload"
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        assert child.wait(60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stderr.close()
    address = ups[0]["Key"].rpartition("/")[2]
    assert not store.blobs.exists(address) and {b.key for b in store.blobs.iter_blobs()} == before
    assert store.policy("pol").head is None and store.catalog.count() == 0
    assert [state for _, state in store.blobs.temp_states()] == ["dead"]  # same host, its pid is gone
    rev = store.publish("pol", _big_revision(), step=1)  # the retry, with the dead upload still there
    assert rev.id == address and store.blobs.exists(address)
    reopened = AdapterStore.open(store_root)
    assert reopened.blobs.swept_on_open == 1 and reopened.load_adapter("pol")["w"].equal(_big_revision()["w"])
    assert not _uploads(store.blobs) and not store.blobs.temp_items()


@pytest.mark.parametrize("store_root", ["s3"], indirect=True)
def test_s3_live_upload_is_never_swept(store_root, tmp_path):
    """A live writer's unfinished upload survives gc with no grace and a store opened beside it, then completes."""
    import hashlib
    import io
    import threading
    import time

    store = AdapterStore.open(store_root, str(tmp_path / "catalog.sqlite"), create=True)
    part = store.blobs.part_size
    data = bytes(range(256)) * ((2 * part + 1000) // 256)
    release = threading.Event()

    class HeldSpool(io.BytesIO):
        """The writer's spool, holding back every part after the first until released."""

        def read(self, n=-1):
            if self.tell() >= part:
                release.wait(120)
            return super().read(n)

    key = hashlib.sha256(data).hexdigest()
    errors = []
    upload = threading.Thread(target=lambda: _run(errors, store.blobs.put_multipart, key, HeldSpool(data), len(data)))
    upload.start()
    try:
        deadline = time.monotonic() + 60
        while not any(state == "live" for _, state in store.blobs.temp_states()):
            assert time.monotonic() < deadline and upload.is_alive(), errors
            time.sleep(0.01)
        assert store.gc(grace_s=0).temp_files_deleted == 0
        assert AdapterStore.open(store_root).blobs.swept_on_open == 0
        assert not store.blobs.exists(key)
    finally:
        release.set()
        upload.join(120)
    assert not errors and store.blobs.read_bytes(key) == data
    assert not store.blobs.temp_items()


def _run(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported by the test's assertion
        errors.append(exc)
