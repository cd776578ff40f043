"""vLLM-on-CPU fixtures and the both-forms patch harness for tests/vllm.

vLLM 0.33 imports on CPU with `VLLM_TARGET_DEVICE=cpu` (set by the suite conftest); its parallel linears
need a (gloo, world size 1) tensor-parallel group and a current `VllmConfig`, which `vllm_cpu` provides and
tears down, so megatron-core tests in the same session can build their own process groups afterwards.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from dsv4flash.patchseries.testing import (  # noqa: F401  (pytest hooks and the patch_form fixture)
    patch_form,
    pytest_collection_modifyitems,
    pytest_generate_tests,
    pytest_pyfunc_call,
    pytest_runtest_logreport,
    pytest_sessionfinish,
)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="module")
def vllm_cpu():
    """A current VllmConfig plus vLLM's distributed env (gloo, TP=1) for building real vLLM layers."""
    pytest.importorskip("vllm", reason="vllm is not installed")
    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if dist.is_initialized():
        pytest.skip("another test left a torch.distributed process group alive")
    config = VllmConfig()
    with set_current_vllm_config(config), tempfile.TemporaryDirectory(prefix="vllm-gloo-") as tmp:
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{tmp}/rdzv",
                                        local_rank=0, backend="gloo")
        ps.initialize_model_parallel(1, 1)
        try:
            yield config
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
