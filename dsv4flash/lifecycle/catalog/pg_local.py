"""A throwaway local PostgreSQL server (tests, fault cases, benchmarks): initdb in a temp dir, unix socket only.

The machine may run as root, which postgres refuses: the cluster is then owned by a `postgres` system user
(created if missing). The server listens on no TCP address, runs with fsync off, and is stopped and deleted
when the context exits.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["postgres_bin", "throwaway_server"]


def postgres_bin() -> Path | None:
    """The directory holding `initdb` and `pg_ctl` (newest Debian cluster version first), or None."""
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                      key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0, reverse=True)
    for d in versions:
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
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "postgres"],
                       check=True)
    return "postgres"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def throwaway_server() -> Iterator[str]:
    """Start a server; yield its libpq DSN (`host=<socket dir> port=N user=postgres dbname=postgres`)."""
    bindir = postgres_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL server not installed (run ci/install_postgres.sh)")
    user = _server_user()
    root = Path(tempfile.mkdtemp(prefix="dsv4flash-pg-"))
    data, sock, log = root / "data", root / "sock", root / "server.log"
    sock.mkdir()
    if user:
        shutil.chown(root, user)
        shutil.chown(sock, user)
    as_user = {"user": user} if user else {}
    try:
        subprocess.run([bindir / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, **as_user)
        port = _free_port()
        opts = (f"-c listen_addresses='' -k {sock} -p {port} -c fsync=off -c synchronous_commit=off "
                f"-c max_connections=200")
        started = subprocess.run([bindir / "pg_ctl", "-D", data, "-o", opts, "-l", log, "-w", "-t", "60", "start"],
                                 capture_output=True, text=True, **as_user)
        if started.returncode != 0:
            text = log.read_text() if log.exists() else ""
            raise RuntimeError(f"could not start a PostgreSQL server: {started.stderr}\n{text[-2000:]}")
        try:
            yield f"host={sock} port={port} user=postgres dbname=postgres"
        finally:
            subprocess.run([bindir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"], capture_output=True,
                           **as_user)
    finally:
        shutil.rmtree(root, ignore_errors=True)
