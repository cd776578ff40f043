"""vLLM-on-CPU fixtures for tests/vllm (the both-forms patch harness comes from tests/conftest.py).

vLLM 0.33 imports on CPU with `VLLM_TARGET_DEVICE=cpu` (set by the suite conftest); its parallel linears
need a (gloo, world size 1) tensor-parallel group and a current `VllmConfig`, which `vllm_cpu` provides and
tears down, so megatron-core tests in the same session can build their own process groups afterwards.
"""

from __future__ import annotations

import os

import pytest


os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="module")
def vllm_cpu():
    """A current VllmConfig plus vLLM's distributed env (gloo, TP=1) for building real vLLM layers."""
    import vllm  # noqa: F401  (a test dependency: ci/install.sh test)
    from tests.vllm._vllm_helpers import cpu_env

    with cpu_env() as config:
        yield config
