"""RestClient over the lifecycle store: runs, checkpoints, delete, publish, TTL expiry, archive URL, gc."""

import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

import dsv4flash.service as tinker
from dsv4flash.service import types


def _train(service, seed=0, **kw):
    tc = service.create_lora_training_client(rank=2, preset="decoder_half", seed=seed, **kw)
    datum = types.Datum(model_input=types.ModelInput.from_ints([0, 5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [5, 6, 7, 8], "weights": [1.0] * 4})
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2))
    return tc


@pytest.fixture
def service(resident, tmp_path):
    return tinker.ServiceClient(root=tmp_path, resident=resident)


def test_runs_and_checkpoints_are_listed_like_tinker(service):
    a = _train(service, user_metadata={"team": "rl"})
    b = _train(service, seed=1)
    pa = a.save_state("s1").result().path
    time.sleep(0.01)
    ps = a.save_weights_for_sampler("s1").result().path
    b.save_state("only").result()
    rest = service.create_rest_client()
    listing = rest.list_checkpoints(a.run_id).result().checkpoints
    assert [c.tinker_path for c in listing] == [ps, pa]  # newest first
    assert [c.checkpoint_type for c in listing] == ["sampler", "training"]
    assert listing[1].checkpoint_id == "weights/s1" and listing[1].size_bytes > 0 and not listing[1].public
    run = rest.get_training_run(a.run_id).result()
    assert run.lora_rank == 2 and run.is_lora and run.user_metadata == {"team": "rl"}
    assert run.last_checkpoint.tinker_path == pa and run.last_sampler_checkpoint.tinker_path == ps
    assert rest.get_training_run_by_tinker_path(pa).result().training_run_id == a.run_id
    runs = rest.list_training_runs(limit=1).result()
    assert len(runs.training_runs) == 1 and runs.cursor.total_count == 2
    users = rest.list_user_checkpoints().result()
    assert users.cursor.total_count == 3
    rest.publish_checkpoint_from_tinker_path(pa).result()
    assert rest.list_checkpoints(a.run_id).result().checkpoints[1].public
    rest.unpublish_checkpoint_from_tinker_path(pa).result()
    assert not rest.list_checkpoints(a.run_id).result().checkpoints[1].public
    with pytest.raises(Exception, match="nope"):
        rest.get_training_run("nope").result()


def test_listings_page_in_the_catalog(service, monkeypatch):
    """A page of runs or of every run's checkpoints reads its own rows, not the store's every policy (10^6 runs
    in a shared catalog): with 60 runs, a page of 5 reads at most 5 runs, in the order and with the total of the
    whole list (runs most recently updated first; checkpoints newest first, ties by run then name, descending)."""
    import hashlib

    from dsv4flash.lifecycle.catalog import RevisionRecord

    cat, fp = service.store.catalog, service.fingerprint()
    for i in range(60):  # catalog rows only: a listing reads no adapter bytes
        cat.create_policy(f"run-{i:02d}", fp)
        cat.register(RevisionRecord(hashlib.sha256(b"%d" % i).hexdigest(), f"run-{i:02d}", None, fp.digest, "lora/1",
                                    100 + i, 2, created=1000.0 + i // 2),  # pairs of runs tie on time
                     tags=["weights.a", "sampler_weights.b", "latest"])
    runs = sorted(cat.list_policies(), key=lambda name: (cat.policy(name).updated, name), reverse=True)
    paths = [f"tinker://{run}/{kind}/{name}" for created, run, kind, name in sorted(
        ((1000 + int(run[4:]) // 2, run, kind, name) for run in runs
         for kind, name in (("weights", "a"), ("sampler_weights", "b"))), reverse=True)]
    reads = {"n": 0}
    for method in ("policy", "tags", "lookup"):
        def counted(*args, _read=getattr(cat, method), **kwargs):
            reads["n"] += 1
            return _read(*args, **kwargs)
        monkeypatch.setattr(cat, method, counted)
    rest = service.create_rest_client()
    page = rest.list_training_runs(limit=5, offset=7).result()
    assert [r.training_run_id for r in page.training_runs] == runs[7:12] and page.cursor.total_count == 60
    assert page.training_runs[0].last_checkpoint.tinker_path == f"tinker://{runs[7]}/weights/a"
    assert reads["n"] <= 5 * 5  # per run of the page: its record, its tags, each checkpoint's revision
    reads["n"] = 0
    page = rest.list_user_checkpoints(limit=5, offset=9).result()
    assert [c.tinker_path for c in page.checkpoints] == paths[9:14] and page.cursor.total_count == 120
    assert page.checkpoints[0].size_bytes > 0 and reads["n"] == 0  # the page's rows came with it
    assert [c.tinker_path for c in rest.list_user_checkpoints(limit=500).result().checkpoints] == paths


def test_delete_checkpoint_frees_the_name_and_gc_frees_the_bytes(service):
    tc = _train(service)
    old = tc.save_state("old").result().path
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.save_state("new").result()
    rest = service.create_rest_client()
    before = service.gc(grace_s=0, dry_run=True)
    rest.delete_checkpoint(tc.run_id, "weights/old").result()
    with pytest.raises(FileNotFoundError, match="not in the store"):
        service.create_sampling_client(old)
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.run_id).result().checkpoints] == ["weights/new"]
    report = service.gc(grace_s=0)
    assert before.blobs_deleted == 0 and report.blobs_deleted == 2  # old adapter + its trainer state
    service.create_training_client_from_state_with_optimizer(f"tinker://{tc.run_id}/weights/new")  # still loads
    with pytest.raises(FileNotFoundError):
        rest.delete_checkpoint_from_tinker_path(old).result()


def test_ttl_expires_checkpoints_and_a_name_can_be_saved_again(service):
    tc = _train(service)
    # A TTL long enough that a loaded machine still reaches the "not yet expired" check; the wait below is
    # taken from the recorded expiry, not from a guess of how long the saves took.
    short = tc.save_weights_for_sampler("short", ttl_seconds=3.0).result().path
    service.create_sampling_client(short)  # not yet expired
    keep = tc.save_state("keep", ttl_seconds=3600).result().path
    rest = service.create_rest_client()
    entry = {c.tinker_path: c for c in rest.list_checkpoints(tc.run_id).result().checkpoints}
    assert entry[short].expires_at is not None and entry[keep].expires_at > entry[short].expires_at
    time.sleep(max(0.0, entry[short].expires_at.timestamp() - time.time()) + 0.05)
    with pytest.raises(FileNotFoundError, match="expired"):
        service.create_sampling_client(short)
    assert [c.tinker_path for c in rest.list_checkpoints(tc.run_id).result().checkpoints] == [keep]
    assert tc.save_weights_for_sampler("short").result().path == short  # the name is free again, no TTL now
    service.create_sampling_client(short)
    rest.set_checkpoint_ttl_from_tinker_path(keep, None).result()
    assert rest.list_checkpoints(tc.run_id).result().checkpoints[-1].expires_at is None
    with pytest.raises(ValueError, match=r"ttl_seconds: expected a number of seconds in \[1, 315360000\]"):
        rest.set_checkpoint_ttl_from_tinker_path(keep, 0).result()
    reopened = tinker.ServiceClient(root=service.root, resident=service.base)  # the registry persists
    assert reopened.checkpoints.get(keep) == service.checkpoints.get(keep)


def test_bad_ttls_are_refused_before_saving_and_a_bad_stored_row_never_fails_a_listing(service, caplog):
    import json
    import logging

    tc = _train(service)
    for bad in (10**30, True, 0, -5, float("nan"), "60"):
        with pytest.raises(ValueError, match=r"ttl_seconds: expected a number of seconds in \[1, 315360000\]"):
            tc.save_state("never", ttl_seconds=bad)
    assert "weights.never" not in service.store.catalog.tags(tc.run_id)  # refused before anything was written
    kept = tc.save_state("kept", ttl_seconds=3600).result().path
    # Rows no check stops any more: a registry written before them (ttl_seconds=10**30 stored as 1e30), or by hand.
    registry = service.root / "service" / "checkpoints.json"
    rows = json.loads(registry.read_text())["checkpoints"]
    rows[kept]["expires_at"] = 1e30
    rows["not a path"] = {"expires_at": None, "public": True}
    registry.write_text(json.dumps({"checkpoints": rows}))
    with caplog.at_level(logging.WARNING, logger="dsv4flash.service"):
        reopened = tinker.ServiceClient(root=service.root, resident=service.base)  # a server restart
        listed = reopened.create_rest_client().list_checkpoints(tc.run_id).result().checkpoints
        every = reopened.create_rest_client().list_user_checkpoints().result().checkpoints
    assert [c.tinker_path for c in listed] == [kept] and listed[0].expires_at is None
    assert [c.tinker_path for c in every] == [kept]
    assert "1e+30" in caplog.text and "'not a path'" in caplog.text


def test_external_weights_have_their_own_path_entry_and_a_checked_ttl(service):
    for kind in ("weights", "sampler_weights", "external_weights"):  # a spelling is per kind, never folded
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(f"mint://r-train-0/{kind}/x")
        assert parsed.canonical == f"tinker://r-train-0/{kind}/x"
    tc = _train(service)
    with pytest.raises(ValueError, match=r"ttl_seconds: .* got True"):
        tc.save_weights_external("never", ttl_seconds=True)
    assert "external_weights.never" not in service.store.catalog.tags(tc.run_id)
    external = tc.save_weights_external("out", ttl_seconds=3600).result().path
    sampler = tc.save_weights_for_sampler("out").result().path
    assert service.checkpoints.get(external)["expires_at"] is not None
    assert service.checkpoints.get(sampler)["expires_at"] is None  # not the external checkpoint's entry


def test_archive_url_is_a_peft_directory_of_the_checkpoint(service):
    from dsv4flash.lora import load_peft_adapter, read_adapter_config

    tc = _train(service)
    path = tc.save_weights_for_sampler("export").result().path
    url = service.create_rest_client().get_checkpoint_archive_url_from_tinker_path(path).result().url
    directory = Path(urlparse(url).path)
    assert (directory / "adapter_config.json").exists() and read_adapter_config(directory)["r"] == 2
    from safetensors.torch import load_file

    saved = load_file(str(directory / "adapter_model.safetensors"))
    key = next(k for k in saved if k.endswith("lora_B.weight"))
    assert torch.equal(saved[key], tc.adapter[key.removeprefix("base_model.model.")].detach())
    from dsv4flash.lora import lora_state_dict
    from dsv4flash.model.transformer import Transformer

    fresh = Transformer(service.base.cfg, torch.float32, "cpu", seed=0)
    load_peft_adapter(fresh, directory)  # the directory alone rebuilds the placement
    loaded = lora_state_dict(fresh)
    assert loaded.keys() == tc.adapter.keys()
    assert all(torch.equal(loaded[k], tc.adapter[k].detach()) for k in loaded)
    service.create_rest_client().delete_checkpoint_from_tinker_path(path).result()
    assert not directory.exists()  # deleting a checkpoint removes its archive too


def test_async_twins_double_await(service):
    import asyncio

    tc = _train(service)
    tc.save_state("a").result()
    rest = service.create_rest_client()

    async def main():
        fut = await rest.list_checkpoints_async(tc.run_id)
        return await fut.result_async()

    assert [c.checkpoint_id for c in asyncio.run(main()).checkpoints] == ["weights/a"]
