"""Fixtures of the Megatron-Bridge tests: the import shims, the registration, one single-rank Megatron session."""

from __future__ import annotations

import importlib.util

import pytest

from tests.mcore_cpu.fixtures import cuda_redirect, mcore_parallel  # noqa: F401


@pytest.fixture(scope="session")
def mbridge():
    """megatron-bridge 0.6.x imported through the CPU shims, `DSV41Bridge` registered; -> the integration package."""
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge is not installed")
    from tests.mbridge import shim

    shim.install()
    from dsv4flash.integrations import mbridge

    mbridge.register()
    return mbridge


@pytest.fixture(scope="module")
def mcore(mbridge):
    """One single-rank gloo Megatron session for a module, with one intra-op thread (tiny models)."""
    from tests._threads import single_thread
    from tests.mcore_cpu import parallel

    with single_thread(), parallel.model_parallel(seed=1234):
        yield
