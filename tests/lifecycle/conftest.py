"""Fixtures of the lifecycle tests: fingerprints, stores, both catalog backends, a database per test on the
suite's one throwaway PostgreSQL server (`pg_server`, tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent


@pytest.fixture()
def pg_dsn(pg_server):
    """A fresh, empty database on the session server (dropped afterwards)."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield pg_server.replace("dbname=postgres", f"dbname={name}")
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", "postgres"])
def catalog_url(request, tmp_path):
    """A fresh catalog URL on each backend."""
    if request.param == "sqlite":
        return str(tmp_path / "catalog.sqlite")
    return request.getfixturevalue("pg_dsn")


@pytest.fixture(params=["dir", "s3"])
def store_root(request, tmp_path):
    """Where a test's store lives, on each blob backend: a directory, or a prefix of a fresh bucket."""
    if request.param == "dir":
        return tmp_path / "store"
    return request.getfixturevalue("s3_url")


def _overwrite_blob(store, key: str, data: bytes) -> None:
    from dsv4flash.lifecycle.default_store import is_remote_store

    if is_remote_store(store.root):
        store.blobs.s3.put_object(Bucket=store.blobs.bucket, Key=store.blobs.object_key(key), Body=data)
        return
    path = store.blobs.path(key)
    os.chmod(path, 0o644)
    path.write_bytes(data)


@pytest.fixture()
def overwrite_blob():
    """`overwrite_blob(store, key, data)`: replace a stored blob's bytes behind the store's back (a corruption on
    disk or in the bucket; the one place a test reaches past the backend interface)."""
    return _overwrite_blob


@pytest.fixture()
def base_fp():
    """A small base fingerprint (no model build)."""
    from dsv4flash.lifecycle.fingerprint import fingerprint_from_parts

    return fingerprint_from_parts('{"model_type": "toy", "hidden_size": 8}', [("w.weight", "BF16", (8, 8))])


@pytest.fixture()
def other_fp():
    """A fingerprint of a different base."""
    from dsv4flash.lifecycle.fingerprint import fingerprint_from_parts

    return fingerprint_from_parts('{"model_type": "toy", "hidden_size": 16}', [("w.weight", "BF16", (16, 16))])


def make_adapter(seed: int = 0, **kw):
    """A small packed MoE adapter with one dense module."""
    from dsv4flash.lifecycle.packed import PackedMoELoRA

    args = dict(layers=[0, 2], num_experts=4, hidden=8, moe_inter=6, rank=2, dense_shapes={"layers.0.attn.wq_a": (5, 8)}, seed=seed)
    args.update(kw)
    return PackedMoELoRA.random(**args)


@pytest.fixture()
def adapter_factory():
    """`make_adapter(seed, **shape)`."""
    return make_adapter


def run_python(code: str, *, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter of this venv (with the repo importable)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout)


@pytest.fixture()
def run_py():
    """`run_python(code, env=..., timeout=...)` (a fresh interpreter per call)."""
    return run_python


@pytest.fixture()
def fork():
    """`fork_run(fn, crash_at=...)` -> wait status (the fault cases' forked child, `dsv4flash.faultcases.context`)."""
    from dsv4flash.faultcases.context import fork_run

    return fork_run
