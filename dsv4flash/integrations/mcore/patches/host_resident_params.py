"""Runtime twin of DSV41-MCORE-005: DDP and the Megatron optimizer skip parameters marked `host_resident`.

Why: megatron-core 0.19.x puts every parameter with `requires_grad` into DDP's contiguous device grad buffer
(with a grad hook), broadcasts it in `broadcast_params` and gives it device optimizer state: a huge row-lookup
table kept in host memory and trained with a sparse host update then costs a device-sized gradient, a dense
all-reduce and device optimizer state. The only way around it today is not to make the table a parameter.

How: a parameter with `param.host_resident = True` is hidden from the stock code paths that collect
trainable parameters, by turning its `requires_grad` off for the duration of `DistributedDataParallel.__init__`
(no buffer, no `main_grad`, no hook) and of `optimizer._get_param_groups` (no optimizer state), and restoring it
afterwards; `broadcast_params` skips it. Its gradient stays in `param.grad`. Parameters without the attribute
are untouched. The format-patch adds `megatron.core.utils.is_host_resident` and checks it in those places.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Iterator

import torch

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin

TOUCHES = (
    "megatron.core.utils.is_host_resident",
    "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.__init__",
    "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.broadcast_params",
    "megatron.core.optimizer._get_param_groups",
)


def is_host_resident(param: torch.nn.Parameter) -> bool:
    """Whether a parameter is kept in host memory and updated by its owner (`param.host_resident`)."""
    return bool(getattr(param, "host_resident", False))


@contextlib.contextmanager
def _hidden_from_collection(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Trainable host-resident parameters look frozen inside the block (so stock code skips them)."""
    hidden = [p for m in modules for p in m.parameters() if p.requires_grad and is_host_resident(p)]
    for param in hidden:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in hidden:
            param.requires_grad_(True)


def _ddp_init(original):
    @functools.wraps(original)
    def __init__(self, config, ddp_config, module, *args, **kwargs):
        with _hidden_from_collection([module]):
            original(self, config, ddp_config, module, *args, **kwargs)

    return __init__


def _param_groups(original):
    @functools.wraps(original)
    def _get_param_groups(model_chunks, *args, **kwargs):
        with _hidden_from_collection(model_chunks):
            return original(model_chunks, *args, **kwargs)

    return _get_param_groups


def _broadcast_params(original):
    @functools.wraps(original)
    def broadcast_params(self):
        """Stock broadcast of every parameter across DP ranks, host-resident ones excepted."""
        for param in self.module.parameters():
            if is_host_resident(param):
                continue
            group = self.expt_dp_group if not getattr(param, "allreduce", True) else self.dp_cp_group
            torch.distributed.broadcast(param.data, src=torch.distributed.get_global_rank(group, 0), group=group)

    return broadcast_params


def upstream_skips_host_resident() -> bool:
    """Probe: does the installed megatron-core know the host_resident attribute?"""
    from megatron.core import utils

    probe = getattr(utils, "is_host_resident", None)
    if probe is None:
        return False
    param = torch.nn.Parameter(torch.zeros(1))
    param.host_resident = True
    return probe(param) is True and probe(torch.nn.Parameter(torch.zeros(1))) is False


@mcore_twin(
    patch_id="DSV41-MCORE-005",
    versions=">=0.19.0,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_HOST_RESIDENT_PARAMS",
    tests=("tests/patches/test_mcore_host_resident_params.py",),
    upstream_has_it=upstream_skips_host_resident,
)
def install(patcher: Patcher) -> None:
    """Wrap DDP construction, DDP's broadcast and the optimizer's parameter grouping."""
    from megatron.core import optimizer
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    patcher.replace(DistributedDataParallel, "__init__", _ddp_init(DistributedDataParallel.__init__))
    patcher.replace(DistributedDataParallel, "broadcast_params",
                    _broadcast_params(DistributedDataParallel.broadcast_params))
    patcher.replace(optimizer, "_get_param_groups", _param_groups(optimizer._get_param_groups))
