"""Fixtures of the lifecycle tests: fingerprints, stores, both catalog backends, a throwaway PostgreSQL.

The PostgreSQL server is real (Debian's package, `ci/install_postgres.sh`): initdb in a temp dir, run
as a non-root user (the machine runs as root and postgres refuses root), listening only on a unix
socket, stopped at the end of the session. Tests that need it skip only when no server is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent


@pytest.fixture(scope="session")
def pg_server():
    """DSN (libpq keywords) of a throwaway PostgreSQL server for this test session."""
    from dsv4flash.lifecycle.catalog.pg_local import postgres_bin, throwaway_server

    if postgres_bin() is None:
        pytest.skip("PostgreSQL server not installed (run ci/install_postgres.sh)")
    import psycopg  # noqa: F401  (a test dependency: ci/install.sh test)
    try:
        server = throwaway_server()
        dsn = server.__enter__()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield dsn
    finally:
        server.__exit__(None, None, None)


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
