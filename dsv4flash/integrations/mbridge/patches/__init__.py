"""Runtime twins for megatron-bridge, one module per upstream change (Patch-Id `DSV41-MBRIDGE-NNN`).

Every module here registers itself with `dsv4flash.patching.twins.runtime_patch`; `twins.discover()` imports
them all and `dsv4flash.integrations.mbridge.register()` applies them. The upstream form of each lives in
`patches/megatron-bridge/` under the same Patch-Id. Importing a twin module imports no megatron-bridge;
`install` does (on a CPU machine after `dsv4flash.cpu_mode.mbridge_import.install()`).
"""

import functools
import sys

from dsv4flash.patching.twins import runtime_patch

mbridge_twin = functools.partial(runtime_patch, target="NVIDIA-NeMo/Megatron-Bridge", distribution="megatron-bridge",
                                 versions=">=0.6.2,<0.7.0", upstream_status="Pending", forwarded="no",
                                 remove_when="megatron-bridge>=0.7.0")


def import_bridge() -> None:
    """Make `megatron.bridge` importable for a probe: as is, or in CPU development mode on Python 3.11 without CUDA."""
    try:
        import megatron.bridge  # noqa: F401
        return
    except ImportError:
        import torch

        if sys.version_info >= (3, 12) or torch.cuda.is_available():
            raise  # a real install problem: the CPU development mode does not apply here
    from dsv4flash.cpu_mode import mbridge_import

    mbridge_import.install()
