"""veRL-on-CPU fixtures for tests/verl (the both-forms harness comes from tests/conftest.py).

verl 0.9.1 imports without a GPU; its vLLM-side modules need vLLM importable on CPU (`VLLM_TARGET_DEVICE=cpu`,
set by the suite conftest) and its Megatron-side ones megatron-core with the CUDA redirect (tests/mcore_cpu).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def vllm_cpu():
    """vLLM's config + distributed env (gloo, TP=1)."""
    import vllm  # noqa: F401  (a test dependency: ci/install.sh test)
    from tests.vllm._vllm_helpers import cpu_env

    with cpu_env() as config:
        yield config


@pytest.fixture
def mcore_parallel():
    """Single-rank gloo group + `initialize_model_parallel(1, 1)` under the CUDA redirect (megatron-core on CPU)."""
    import megatron.core  # noqa: F401  (a test dependency: ci/install.sh test)
    from tests.mcore_cpu import parallel

    with parallel.model_parallel(seed=1234):
        yield parallel
