"""DSV41-VERL-007: veRL's Ray resource check counts the resource the platform places its pools with."""

from __future__ import annotations

import pytest

from tests.verl import _cpu_platform
from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-007"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]

CPU_NODE = {"node-a": {"CPU": 4.0, "memory": 1e9}}
GPU_NODES = {"node-a": {"CPU": 64.0, "GPU": 8.0}, "node-b": {"CPU": 64.0, "GPU": 8.0}}


def _fits(nodes: dict, process_on_nodes: list[int]) -> bool:
    """Whether veRL's ResourcePoolManager accepts `process_on_nodes` on a cluster reporting `nodes`."""
    import ray._private.state
    from verl.single_controller.ray.base import ResourcePoolManager

    manager = ResourcePoolManager(resource_pool_spec={"global_pool": process_on_nodes}, mapping={})
    saved = ray._private.state.available_resources_per_node
    ray._private.state.available_resources_per_node = lambda: nodes  # what Ray's GCS would report
    try:
        manager._check_resource_available()
        return True
    except ValueError:
        return False
    finally:
        ray._private.state.available_resources_per_node = saved


def test_check_counts_the_platform_resource(patch_form):
    with _cpu_platform.platform("cpu"):
        cpu = [_fits(CPU_NODE, [2]), _fits(CPU_NODE, [4]), _fits(CPU_NODE, [5])]
    with _cpu_platform.platform("nvidia"):
        gpu = [_fits(GPU_NODES, [8, 8]), _fits(GPU_NODES, [8, 8, 1])]
    assert cpu == [True, True, False] and gpu == [True, False]
    patch_form.record("cpu", cpu)
    patch_form.record("gpu", gpu)


def test_stock_check_refuses_a_cpu_cluster():
    with stock(PATCH_ID), _cpu_platform.platform("cpu"):
        assert not _fits(CPU_NODE, [2])
