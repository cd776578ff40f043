"""Runtime twin of DSV41-VERL-007: the Ray resource check counts the platform's own accelerator resource.

Why: `ResourcePoolManager._check_resource_available` sums each node's `GPU` (or, without one, `NPU`)
resources, while the pools it checks are placed with `get_platform().ray_resource_name()`. On any other
platform (the CPU development platform's `CPU`, a vendor plugin's custom resource) the check counts 0 and
refuses a cluster that can hold the pools ("Total available GPUs 0 is less than total desired GPUs 2").

How: count `get_platform().ray_resource_name()` per node, the resource the pools request. Unchanged on
CUDA (`GPU`) and NPU (`NPU`).
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = ("verl.single_controller.ray.base.ResourcePoolManager._check_resource_available",)


def upstream_counts_platform_resource() -> bool:
    """Probe: does veRL's check accept one process on a node offering one unit of the platform's resource?"""
    import ray._private.state as state
    from verl.single_controller.ray.base import ResourcePoolManager

    from dsv4flash.integrations.verl.probe_platform import probe_platform

    manager = ResourcePoolManager(resource_pool_spec={"probe": [1]}, mapping={})
    reported = state.available_resources_per_node
    state.available_resources_per_node = lambda: {"probe-node": {"CPU": 1.0, "dsv4flash_probe": 1.0}}
    try:
        with probe_platform(resource="dsv4flash_probe"):
            manager._check_resource_available()
        return True
    except ValueError:
        return False
    finally:
        state.available_resources_per_node = reported


@verl_twin(
    patch_id="DSV41-VERL-007",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_RAY_RESOURCE_CHECK",
    tests=("tests/verl/test_ray_resource_check.py",),
    upstream_has_it=upstream_counts_platform_resource,
)
def install(patcher: Patcher) -> None:
    """Replace the check with one that counts the platform's Ray resource."""
    from verl.single_controller.ray.base import ResourcePoolManager

    def _check_resource_available(self):
        """Check if the resource pool can be satisfied in this ray cluster (the platform's resource)."""
        import ray
        from verl.plugin.platform import get_platform

        resource = get_platform().ray_resource_name()
        available = sum(info.get(resource, 0) for info in ray._private.state.available_resources_per_node().values())
        required = sum(n for process_on_nodes in self.resource_pool_spec.values() for n in process_on_nodes)
        if available < required:
            raise ValueError(f"Total available {resource} {available} is less than total desired {resource} "
                             f"{required}")

    patcher.replace(ResourcePoolManager, "_check_resource_available", _check_resource_available)
