"""Fixtures of the Megatron-Bridge tests: the import shims, the registration, one single-rank Megatron session."""

from __future__ import annotations

import importlib.util

import pytest

from tests.mcore_cpu.fixtures import cuda_redirect, mcore_parallel  # noqa: F401


@pytest.fixture(scope="module")
def mbridge():
    """megatron-bridge 0.6.x imported through the CPU shims, `DSV41Bridge` registered and the megatron-bridge
    runtime twins applied for the module (they and the twins they pulled in are reverted after it, so no later
    test sees them); -> the package."""
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge is not installed")
    from tests.mbridge import shim

    shim.install()
    from dsv4flash.patching import twins
    from dsv4flash.integrations import mbridge

    active_before = {t.meta.patch_id for t in twins.REGISTRY.all() if t.applied}
    mbridge.register()
    yield mbridge
    # Every twin the registration applied, the megatron-core twins its Depends-On pulled in too (DSV41-MBRIDGE-005
    # applies DSV41-MCORE-012 and, through it, 004/003/001).
    for twin in reversed(twins.REGISTRY.all()):
        if twin.applied and twin.meta.patch_id not in active_before:
            twin.revert()


@pytest.fixture(scope="module")
def mcore(mbridge):
    """One single-rank gloo Megatron session for a module, with one intra-op thread (tiny models)."""
    from tests._threads import single_thread
    from tests.mcore_cpu import parallel

    with single_thread(), parallel.model_parallel(seed=1234):
        yield
