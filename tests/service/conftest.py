"""One resident tiny base per test module (building it is the slow part)."""

import pytest

from dsv4flash.engine.resident import ResidentBase


@pytest.fixture(scope="module")
def resident():
    """The resident tiny base shared by a module's tests."""
    return ResidentBase("tiny", seed=0)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (`one_thread` in tests/conftest.py)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A `dsv4flash serve` subprocess on 127.0.0.1 (ephemeral port) with the test keys, shared by a module."""
    from tests.service.http_server import running_server, write_keys

    root = tmp_path_factory.mktemp("serve")
    with running_server(root / "store", write_keys(root / "keys")) as srv:
        yield srv


@pytest.fixture(scope="module")
def sdk(server):
    """The real tinker SDK's ServiceClient on `server`; __exit__ finishes its session."""
    from tests.service.http_server import service_client

    with service_client(server) as client:
        yield client
