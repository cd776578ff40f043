"""One fault context per session: the shared tiny checkpoints and resident base are built once; the suite's
throwaway PostgreSQL server (`pg_server`, tests/conftest.py) is started only when a case needs it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fault_context(tmp_path_factory):
    """The `FaultContext` every case runs in (a fresh directory per case under one session root)."""
    from dsv4flash.faultcases.context import FaultContext

    return FaultContext(tmp_path_factory.mktemp("faults"))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny-model work on one intra-op thread, as in the service tests."""
