"""AdapterStore: publish/load round trip, revision identity, trainer state, garbage collection — on each blob
backend (a directory, an S3 bucket on the session's local S3 server) where the case applies."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import torch

from dsv4flash.lifecycle.errors import HeadConflictError, IntegrityError, LifecycleError
from dsv4flash.lifecycle.revision import MANIFEST_KEY
from dsv4flash.lifecycle.safetensors_io import read_header
from dsv4flash.lifecycle.store import AdapterStore


def _open(root, tmp_path) -> AdapterStore:
    """The store at `root`, created on first use (an s3:// store records a SQLite catalog beside the test)."""
    return AdapterStore.open(root, None if isinstance(root, os.PathLike) else tmp_path / "catalog.sqlite", create=True)


@pytest.fixture()
def store(store_root, tmp_path, base_fp):
    s = _open(store_root, tmp_path)
    s.create_policy("pol", base_fp)
    return s


def test_revision_is_content_addressed_and_self_describing(store, adapter_factory, base_fp, tmp_path):
    ad = adapter_factory(0)
    r1 = store.publish("pol", ad, step=1)
    copy = tmp_path / "r1.safetensors"
    copy.write_bytes(store.blobs.read_bytes(r1.id, verify=False))
    assert r1.id == hashlib.sha256(copy.read_bytes()).hexdigest() and r1.manifest.parent is None
    header = read_header(copy)
    assert MANIFEST_KEY in header.metadata and header.metadata["format"] == "pt"
    m = r1.manifest
    assert (m.format, m.rank, m.alpha, m.num_experts, m.base, m.policy) == ("packed_moe_lora/1", 2, 4.0, 4, base_fp, "pol")
    assert "ffn.experts.w1" in m.targets and "attn.wq_a" in m.targets
    # republishing identical content on the same parent is the same revision (idempotent save)
    r2 = store.publish("pol", ad, step=2)
    assert r2.parent == r1.id and r2.id != r1.id  # different parent/step -> different bytes
    again = store.publish("pol", ad, parent=r1.id, step=2, expect_head=r2.id)
    assert again.id == r2.id and store.catalog.count() == 2
    assert store.load_adapter(r1.id).equal(ad)


def test_generic_module_state_revision(store):
    weights = {"head.weight": torch.randn(3, 4), "lora_a": torch.randn(2, 4, dtype=torch.float64)}
    rev = store.publish("pol", weights, step=5)
    assert rev.manifest.format == "module_state/1"
    back = store.load_adapter(rev.id)
    assert all(torch.equal(back[k], v) for k, v in weights.items())


def test_stale_head_is_refused(store, adapter_factory):
    r1 = store.publish("pol", adapter_factory(0))
    with pytest.raises(HeadConflictError):
        store.publish("pol", adapter_factory(1), parent=r1.id, expect_head="0" * 64)
    assert store.policy("pol").head == r1.id


def test_trainer_state_and_corruption(store, adapter_factory, overwrite_blob):
    rev = store.publish("pol", adapter_factory(0), step=3, trainer_state=b"moments", scheduler={"last_epoch": 3},
                        data_position={"epoch": 0, "index": 6})
    state, blob = store.trainer_state("pol", "pol:head")
    assert blob == b"moments" and state.step == 3 and state.data_position["index"] == 6
    data = bytearray(store.blobs.read_bytes(rev.id))
    data[-1] ^= 0xFF
    overwrite_blob(store, rev.id, bytes(data))
    with pytest.raises(IntegrityError, match="hashes to"):
        store.load(rev.id)
    with pytest.raises(IntegrityError, match="hashes to"):
        store.blobs.verify(rev.id)


def test_gc_collects_retired_and_orphaned_bytes_only(store, adapter_factory):
    r1 = store.publish("pol", adapter_factory(0), trainer_state=b"s1")
    r2 = store.publish("pol", adapter_factory(1), trainer_state=b"s2", tags=["prod"])
    r3 = store.publish("pol", adapter_factory(2))
    orphan = store.blobs.put_bytes(b"an abandoned publish")
    assert store.gc(grace_s=3600).blobs_deleted == 0  # everything is young
    report = store.gc(grace_s=0, dry_run=True)
    assert report.blobs_deleted == 1 and store.blobs.exists(orphan)
    assert store.gc(grace_s=0).blobs_deleted == 1 and not store.blobs.exists(orphan)
    store.catalog.retire(r1.id)
    report = store.gc(grace_s=0)
    assert report.blobs_deleted == 2  # r1 and its trainer state
    assert not store.blobs.exists(r1.id) and store.blobs.exists(r2.id) and store.blobs.exists(r3.id)
    with pytest.raises(LifecycleError, match="bytes are missing.*retired and collected"):
        store.load(r1.id)
    assert store.load_adapter("pol:prod").equal(adapter_factory(1))


@pytest.mark.parametrize("store_root", ["dir"], indirect=True)  # S3 cannot backdate an object: the next test
def test_gc_grace_protects_in_flight_publish(store, adapter_factory):
    orphan = store.blobs.put_bytes(b"being published right now")
    old = time.time() - 7200
    os.utime(store.blobs.path(orphan), (old, old))
    # a publish that deduplicates onto an old orphan refreshes its mtime, so gc leaves it alone
    assert store.blobs.put_bytes(b"being published right now") == orphan
    assert store.gc(grace_s=3600).blobs_deleted == 0 and store.blobs.exists(orphan)


@pytest.mark.parametrize("store_root", ["s3"], indirect=True)
def test_s3_republish_refreshes_the_objects_age(store):
    """The S3 form of the grace guarantee: a put that deduplicates onto a stored object renews its LastModified (a
    server-side self-copy), so gc's grace period counts from the latest publish of those bytes."""
    key = store.blobs.put_bytes(b"being published right now")
    first = {b.key: b.mtime for b in store.blobs.iter_blobs()}[key]
    time.sleep(1.05)  # S3 keeps LastModified to the second
    assert store.blobs.put_bytes(b"being published right now") == key
    assert {b.key: b.mtime for b in store.blobs.iter_blobs()}[key] > first
    assert store.blobs.read_bytes(key) == b"being published right now"


def test_first_publish_is_compare_and_set_too(store_root, tmp_path, base_fp, adapter_factory):
    """Two writers that both saw an empty policy must not both become its root (regression)."""
    a = _open(store_root, tmp_path)
    a.create_policy("pol", base_fp)
    b = AdapterStore.open(store_root)
    stale = b.policy("pol")  # b reads the policy while it has no head …
    first = a.publish("pol", adapter_factory(0))  # … then a publishes the first revision
    b.catalog.policy = lambda name: stale  # b still acts on what it read
    with pytest.raises(HeadConflictError, match="expected head None"):
        b.publish("pol", adapter_factory(1))
    assert a.policy("pol").head == first.id and a.catalog.count() == 1


def test_revision_file_is_readable_outside_the_store(store, adapter_factory, base_fp, other_fp, tmp_path):
    from dsv4flash.lifecycle.errors import BaseMismatchError
    from dsv4flash.lifecycle.revision import read_revision_file

    rev = store.publish("pol", adapter_factory(3), step=9)
    copy = tmp_path / "copied.safetensors"
    copy.write_bytes(store.blobs.read_bytes(rev.id))
    tensors, manifest, _ = read_revision_file(copy, resident_base=base_fp)
    assert manifest == rev.manifest and manifest.step == 9 and len(tensors) == rev.n_tensors
    with pytest.raises(BaseMismatchError, match="copied.safetensors"):
        read_revision_file(copy, resident_base=other_fp)
