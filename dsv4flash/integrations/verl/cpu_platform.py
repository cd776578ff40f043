"""veRL CPU development mode: a `cpu` platform in veRL's platform registry (`VERL_PLATFORM=cpu`).

veRL 0.9.1 routes every device call through `verl.plugin.platform.get_platform()`; its registry has CUDA,
NPU and ROCm. This platform lets the same distributed code (Ray worker groups, process groups, engines)
run on CPUs over gloo, so the whole pipeline runs on a laptop or a CPU CI machine. It is selected only by
`VERL_PLATFORM=cpu` (never auto-detected: a CPU-only Ray head node driving GPU workers must keep veRL's
own detection), and it refuses to start where a CUDA device is visible. Ray workers inherit the variable
and load this module through the `verl.plugins` entry point on `import verl`.

The device module wraps `torch.cpu` with what veRL calls on `torch.cuda`: memory queries (0, or the host's
free/total memory), cache and IPC no-ops, and the RNG through torch's default (CPU) generator.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Any, Optional

import torch

PLATFORM_NAME = "cpu"
ENV = "VERL_PLATFORM"


class CPUDeviceModule(ModuleType):
    """`torch.cpu` plus the `torch.cuda` calls veRL makes, as CPU no-ops or host-memory figures."""

    def __init__(self) -> None:
        super().__init__("dsv4flash.cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> str:
        """`"cpu"`: veRL passes it to `.to()` / `torch.device()`, where an int would mean cuda:N."""
        return "cpu"

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """(free, total) host memory in bytes."""
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)


def cuda_visible() -> bool:
    """Whether a CUDA device is usable in this process (then the CPU platform must not run)."""
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # a broken CUDA install counts as none
        return False


def register_platform() -> type:
    """Register `PlatformCPU` as veRL's `cpu` platform (idempotent) -> the class."""
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    existing = PlatformRegistry.get(PLATFORM_NAME)
    if existing is not None and getattr(existing, "__module__", "") == __name__:
        return existing

    @PlatformRegistry.register(platform=PLATFORM_NAME)
    class PlatformCPU(PlatformBase):
        """veRL on CPUs: gloo collectives, Ray `CPU` resources, the `CPUDeviceModule` device module."""

        __module__ = __name__
        _device = CPUDeviceModule()

        def __init__(self) -> None:
            if cuda_visible():
                raise RuntimeError(f"{ENV}=cpu selects the CPU development platform, but a CUDA device is visible "
                                   f"here; unset {ENV} to use veRL's GPU platform")

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return self._device

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False  # never auto-detected; only VERL_PLATFORM=cpu selects it

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "DSV4FLASH_CPU_VISIBLE_DEVICES"  # nothing to hide on CPUs; veRL only reads and forwards it

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            # Ray names CPUs `num_cpus`; `resources={"CPU": n}` is refused.
            return {"num_cpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def selected() -> bool:
    """Whether this process asked veRL for the CPU platform."""
    return os.environ.get(ENV, "").strip().lower() == PLATFORM_NAME


# veRL's Megatron engines, registered for the CUDA device only (`EngineRegistry.register` defaults to cuda).
MEGATRON_ENGINES = (("language_model", "MegatronEngineWithLMHead"), ("value_model", "MegatronEngineWithValueHead"))


def register_cpu_engines() -> None:
    """Register veRL's own Megatron engines for device `cpu` too (idempotent), when their module is imported."""
    from dsv4flash.patching.post_import import when_imported

    def register() -> None:
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.engine.megatron import transformer_impl

        for model_type, name in MEGATRON_ENGINES:
            engine = getattr(transformer_impl, name, None)
            table = EngineRegistry._engines.get(model_type, {}).get("megatron", {})
            if engine is not None and PLATFORM_NAME not in table:
                EngineRegistry.register(model_type=model_type, backend="megatron", device=PLATFORM_NAME)(engine)

    when_imported("verl.workers.engine.megatron.transformer_impl", register)


def enter_cpu_development_mode() -> bool:
    """In a process that selected `VERL_PLATFORM=cpu` (and has no CUDA device): once veRL's Megatron engine
    is imported, install the megatron-core CUDA->CPU redirect and the megatron-bridge import shims (Python
    3.11 `typing.override`, Transformer Engine stubs). True if the mode is active in this process."""
    if not selected() or cuda_visible():
        return False
    from dsv4flash.patching.post_import import when_imported

    def install() -> None:
        from dsv4flash.cpu_mode import mbridge_import, mcore_redirect

        mcore_redirect.install()
        mbridge_import.install()

    when_imported("verl.workers.engine.megatron.transformer_impl", install)
    return True
