"""A throw-away veRL platform for the twins' behavioural probes (no device is touched)."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def probe_platform(device: str = "cpu", backend: str = "gloo", resource: str = "dsv4flash_probe"):
    """veRL's platform singleton set, for the block, to one reporting `device`, `backend` and Ray `resource`."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class ProbePlatform(PlatformCUDA):
        @property
        def device_name(self) -> str:
            return device

        def communication_backend_name(self) -> str:
            return backend

        def ray_resource_name(self) -> str:
            return resource

    saved = platform_manager._current_platform
    platform_manager._current_platform = ProbePlatform()
    try:
        yield platform_manager._current_platform
    finally:
        platform_manager._current_platform = saved
