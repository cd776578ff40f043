"""Runtime twin of DSV41-VERL-006: the default process-group backend on a CPU platform is `cpu:gloo`.

Why: `initialize_global_process_group(_ray)` build `"cpu:gloo,{device}:{backend}"` from the platform, which
on a CPU platform (device `cpu`, backend `gloo`) is `"cpu:gloo,cpu:gloo"`; torch refuses it ("Duplicate
device type cpu in backend string"), so no veRL worker can start its process group on CPUs.

How: the backend comes from `default_backend()`: `cpu:gloo` alone when the device is the CPU, the mixed
string otherwise (unchanged on GPU/NPU). The upstream form adds `default_backend` to
`verl.utils.distributed`; the twin replaces both functions there and in the modules that imported them
by name.
"""

from __future__ import annotations

import sys

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = (
    "verl.utils.distributed.initialize_global_process_group",
    "verl.utils.distributed.initialize_global_process_group_ray",
)
# Modules that bind the functions with `from verl.utils.distributed import ...` (veRL 0.9.1).
IMPORTERS = ("verl.workers.engine_workers", "verl.checkpoint_engine.base", "verl.trainer.sft_trainer")


def default_backend() -> str:
    """`cpu:gloo` plus the accelerator's collective backend; `cpu:gloo` alone when the device is the CPU."""
    from verl.utils.device import get_device_name, get_nccl_backend

    device = get_device_name()
    return "cpu:gloo" if device == "cpu" else f"cpu:gloo,{device}:{get_nccl_backend()}"


def upstream_has_default_backend() -> bool:
    """Probe: on a platform whose device is `cpu`, is veRL's default backend `cpu:gloo`?"""
    from verl.utils import distributed

    from dsv4flash.integrations.verl.probe_platform import probe_platform

    default = getattr(distributed, "default_backend", None)
    if not callable(default):
        return False
    with probe_platform(device="cpu", backend="gloo"):
        return default() == "cpu:gloo"


@verl_twin(
    patch_id="DSV41-VERL-006",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_GLOO_BACKEND_STRING",
    tests=("tests/verl/test_gloo_backend_string.py",),
    upstream_has_it=upstream_has_default_backend,
)
def install(patcher: Patcher) -> None:
    """Replace both initialisers in `verl.utils.distributed` and in the already-imported modules that bound them."""
    import os
    from datetime import timedelta

    import torch.distributed
    from verl.utils import distributed
    from verl.utils.device import get_torch_device

    def initialize_global_process_group(timeout_second=36000):
        """veRL's torchrun-style initialiser with `default_backend()`."""
        torch.distributed.init_process_group(backend=default_backend(), timeout=timedelta(seconds=timeout_second),
                                             init_method=os.environ.get("DIST_INIT_METHOD", None))
        local_rank, rank, world_size = (int(os.environ[k]) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"))
        if torch.distributed.is_initialized():
            get_torch_device().set_device(local_rank)
        return local_rank, rank, world_size

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        """veRL's Ray-worker initialiser with `default_backend()` when no backend is given."""
        timeout = timedelta(seconds=timeout_second) if timeout_second is not None else None
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                backend=backend or default_backend(), rank=int(os.environ.get("RANK", 0)),
                world_size=int(os.environ.get("WORLD_SIZE", 1)), timeout=timeout,
                init_method=os.environ.get("DIST_INIT_METHOD", None))

    fixed = {"initialize_global_process_group": initialize_global_process_group,
             "initialize_global_process_group_ray": initialize_global_process_group_ray}
    stock = {name: getattr(distributed, name) for name in fixed}
    for name, fn in fixed.items():
        patcher.replace(distributed, name, fn)
    for module_name in IMPORTERS:
        module = sys.modules.get(module_name)
        for name, fn in fixed.items():
            if module is not None and getattr(module, name, None) is stock[name]:
                patcher.replace(module, name, fn)
