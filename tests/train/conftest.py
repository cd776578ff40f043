"""Fixtures of the training tests: one intra-op thread (the tiny model's ops are small; a second thread
only adds contention), and a small seeded tiny model."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (`one_thread` in tests/conftest.py)."""
