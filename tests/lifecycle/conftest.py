"""Fixtures of the lifecycle tests: fingerprints, stores, both catalog backends, a throwaway PostgreSQL.

The PostgreSQL server is real (Debian's package, `ci/install_postgres.sh`): initdb in a temp dir, run
as a non-root user (the machine runs as root and postgres refuses root), listening only on a unix
socket, stopped at the end of the session. Tests that need it skip only when no server is installed.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent


def _pg_bin() -> Path | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0, reverse=True):
        if os.access(f"{d}/initdb", os.X_OK) and os.access(f"{d}/pg_ctl", os.X_OK):
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def _server_user() -> str | None:
    """A non-root account to own the cluster (created if the machine runs as root and has none)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "postgres"], check=True)
    return "postgres"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def pg_server():
    """DSN (libpq keywords) of a throwaway PostgreSQL server for this test session."""
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL server not installed (run ci/install_postgres.sh)")
    pytest.importorskip("psycopg", reason='psycopg 3 not installed (pip install "psycopg[binary]")')
    user = _server_user()
    root = Path(tempfile.mkdtemp(prefix="dsv4flash-pg-"))
    data, sock, log = root / "data", root / "sock", root / "server.log"
    sock.mkdir()
    if user:
        shutil.chown(root, user)
        shutil.chown(sock, user)
    as_user = {"user": user} if user else {}
    subprocess.run([bindir / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
                   check=True, capture_output=True, **as_user)
    port = _free_port()
    opts = f"-c listen_addresses='' -k {sock} -p {port} -c fsync=off -c synchronous_commit=off -c max_connections=200"
    started = subprocess.run([bindir / "pg_ctl", "-D", data, "-o", opts, "-l", log, "-w", "-t", "60", "start"],
                             capture_output=True, text=True, **as_user)
    if started.returncode != 0:
        text = log.read_text() if log.exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"could not start the test PostgreSQL server: {started.stderr}\n{text[-2000:]}")
    try:
        yield f"host={sock} port={port} user=postgres dbname=postgres"
    finally:
        subprocess.run([bindir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"], capture_output=True, **as_user)
        shutil.rmtree(root, ignore_errors=True)


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


def fork_run(fn, *, crash_at: str | None = None) -> int:
    """Run `fn()` in a forked child (optionally with a crash point armed); returns its wait status.

    Forking keeps each crash case to milliseconds instead of a fresh interpreter's seconds; the child
    does no torch compute (tensors are built before the fork), only file and database writes.
    """
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            if crash_at:
                os.environ["DSV4FLASH_CRASH_AT"] = crash_at
            fn()
        except BaseException:  # noqa: BLE001 - report through the exit code
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


@pytest.fixture()
def fork():
    """`fork_run(fn, crash_at=...)` -> wait status."""
    return fork_run
