"""`dsv4flash lifecycle` operates a store from the shell: policies, show, log, tag, rollback, gc, export."""

from __future__ import annotations

import json
import os

from dsv4flash.cli import main
from dsv4flash.lifecycle.export import import_vllm_3d
from dsv4flash.lifecycle.store import AdapterStore


def test_lifecycle_cli(store_root, tmp_path, capsys, base_fp, adapter_factory):
    """Every subcommand on a store of each blob backend (an s3:// store is named by its URL alone after creation)."""
    root = store_root
    store = AdapterStore.open(root, None if isinstance(root, os.PathLike) else tmp_path / "c.sqlite", create=True)
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


def test_s3_store_init_and_its_errors(s3_url, tmp_path, capsys, pg_dsn):
    """`init` of an s3:// store records its catalog (a PostgreSQL DSN here); later commands need only the URL;
    a store never created, a catalog left unnamed or a DSN with a password are one-line errors (exit 2)."""
    run = lambda *a: (main(["lifecycle", *a]), capsys.readouterr())  # noqa: E731

    code, out = run("--root", s3_url + "/never", "policies")
    assert code == 2 and out.err.count("\n") == 1 and "no adapter store here" in out.err
    code, out = run("--root", s3_url, "init")
    assert code == 2 and "needs its catalog named" in out.err
    serve = ["serve", "--store", s3_url, "--base", "random-tiny", "--port", "0", "--state-dir", str(tmp_path / "st")]
    assert main(serve) == 2  # refused before any base is built
    assert "no adapter store here" in capsys.readouterr().err
    code, out = run("--root", s3_url, "--catalog", "postgresql://u:secret@db.example/x", "init")
    assert code == 2 and "holds a password" in out.err and "secret" not in out.err
    code, out = run("--root", s3_url, "--catalog", pg_dsn, "init")
    assert code == 0 and s3_url in out.out
    assert AdapterStore.open(s3_url).catalog.list_policies() == []  # the recorded catalog, by URL alone
    code, out = run("--root", s3_url, "policies")
    assert code == 0 and out.err == ""
