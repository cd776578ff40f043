"""Pytest fixtures over `tests.mcore_cpu.shim` / `.parallel`; import them into a conftest to use them."""

from __future__ import annotations

import os

import pytest

# torch.compile (megatron's jit_fuser) costs ~15 s of C++ compilation per fused function on a cold CPU machine.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture
def cuda_redirect():
    """megatron-core imported and the CUDA redirect active for one test (restored afterwards)."""
    import megatron.core  # noqa: F401  (a test dependency: ci/install.sh test)
    from tests.mcore_cpu import shim

    with shim.cuda_redirect():
        yield shim


@pytest.fixture
def mcore_parallel():
    """Single-rank gloo group + `initialize_model_parallel(1, 1)` + seeded Megatron RNG, torn down after."""
    import megatron.core  # noqa: F401  (a test dependency: ci/install.sh test)
    from tests.mcore_cpu import parallel

    with parallel.model_parallel(seed=1234):
        yield parallel
