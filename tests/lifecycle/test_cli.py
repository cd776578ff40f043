"""`dsv4flash lifecycle` operates a store from the shell: policies, show, log, tag, rollback, gc, export."""

from __future__ import annotations

import json

from dsv4flash.cli import main
from dsv4flash.lifecycle.export import import_vllm_3d
from dsv4flash.lifecycle.store import AdapterStore


def test_lifecycle_cli(tmp_path, capsys, base_fp, adapter_factory):
    root = tmp_path / "store"
    store = AdapterStore(root)
    store.create_policy("pol", base_fp)
    r1 = store.publish("pol", adapter_factory(0), step=1)
    r2 = store.publish("pol", adapter_factory(1), step=2, tags=["prod"])
    store.close()
    run = lambda *a: (main(["lifecycle", "--root", str(root), *a]), capsys.readouterr().out)[1]  # noqa: E731

    assert f"head={r2.id[:12]}" in run("policies") and f"prod={r2.id[:12]}" in run("policies")
    shown = json.loads(run("show", r2.id[:10]))
    assert shown["ancestors"] == [r1.id] and shown["bytes_present"] and shown["step"] == 2
    assert run("rollback", "pol", "--tag", "prod").strip() == r1.id[:12]
    assert "rollback" in run("log", "pol", "--tag", "prod")
    assert run("tag", "pol", "eval-best", r2.id).strip() == r2.id[:12]
    assert run("log", "pol").splitlines()[0].startswith(r2.id[:12])
    assert "blobs_deleted=0" in run("gc", "--grace", "0", "--dry-run")
    run("export", "pol:eval-best", str(tmp_path / "v3"), "--layout", "vllm3d")
    assert import_vllm_3d(tmp_path / "v3").equal(adapter_factory(1))
