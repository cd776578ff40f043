"""One resident tiny base per test module (building it is the slow part)."""

import pytest

from dsv4flash.service.resident import ResidentBase


@pytest.fixture(scope="module")
def resident():
    """The resident tiny base shared by a module's tests."""
    return ResidentBase("tiny", seed=0)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (`one_thread` in tests/conftest.py)."""
