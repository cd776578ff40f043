"""DSV41-VERL-006: on the CPU platform veRL's process-group initialisers start a gloo group (`cpu:gloo`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.verl import _cpu_platform
from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-006"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def single_rank_env(monkeypatch):
    assert not dist.is_initialized()
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("initialiser", ["initialize_global_process_group_ray", "initialize_global_process_group"])
def test_cpu_platform_process_group_is_gloo(patch_form, single_rank_env, initialiser):
    from verl.utils import distributed

    with _cpu_platform.platform("cpu"):
        getattr(distributed, initialiser)(timeout_second=60)
        t = torch.tensor([1.0, 2.0])
        dist.all_reduce(t)
    patch_form.record("backend", str(dist.get_backend()))
    patch_form.record("sum", t)


def test_gpu_platforms_keep_the_mixed_backend(patch_form, single_rank_env, monkeypatch):
    """On CUDA the backend string is unchanged (captured before torch would need a GPU for nccl)."""
    from verl.utils import distributed

    seen = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: seen.append(kw["backend"]))
    with _cpu_platform.platform("nvidia"):
        distributed.initialize_global_process_group_ray(timeout_second=60)
    patch_form.record("backend", seen)
    assert seen == ["cpu:gloo,cuda:nccl"]


def test_stock_backend_string_names_cpu_twice(single_rank_env):
    from verl.utils import distributed

    with stock(PATCH_ID), _cpu_platform.platform("cpu"):
        with pytest.raises(ValueError, match="Duplicate device type cpu"):
            distributed.initialize_global_process_group_ray(timeout_second=60)
