"""One fault context per session: the shared tiny checkpoints and resident base are built once; a throwaway
PostgreSQL server is started only when a case needs it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fault_context(tmp_path_factory):
    """The `FaultContext` every case runs in (a fresh directory per case under one session root)."""
    from dsv4flash.faultcases.context import FaultContext

    return FaultContext(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="session")
def postgres_server():
    """DSN of a throwaway PostgreSQL server for the cases that need one."""
    from dsv4flash.lifecycle.catalog.pg_local import postgres_bin, throwaway_server

    if postgres_bin() is None:
        pytest.skip("PostgreSQL server not installed (run ci/install_postgres.sh)")
    import psycopg  # noqa: F401  (a test dependency: ci/install.sh test)
    with throwaway_server() as dsn:
        yield dsn


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny-model work on one intra-op thread, as in the service tests."""
