"""Select veRL's CPU development platform in this process for a test (veRL caches the platform singleton)."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def platform(name: str = "cpu"):
    """veRL's platform singleton set to `name` (`cpu`: dsv4flash's, else a registered one), restored after."""
    from verl.plugin.platform import PlatformRegistry, platform_manager

    from dsv4flash.integrations.verl.cpu_platform import register_platform

    register_platform()
    saved = platform_manager._current_platform
    platform_manager._current_platform = PlatformRegistry.get(name)()
    try:
        yield platform_manager._current_platform
    finally:
        platform_manager._current_platform = saved
