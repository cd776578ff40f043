"""A veRL `Worker` for the CPU-platform Ray test (importable by the Ray worker processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register


class AllReduceWorker(Worker):
    """Starts veRL's process group as veRL's engine workers do, then all-reduces its rank."""

    def __init__(self):
        super().__init__()
        from verl.utils.distributed import initialize_global_process_group_ray

        initialize_global_process_group_ray(timeout_second=120)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self):
        """Each rank's view: platform, device, backend, and the sum of rank + 1 over the group."""
        from verl.plugin.platform import get_platform
        from verl.utils.device import get_device_name, get_torch_device

        t = torch.tensor([float(self.rank + 1)], device=get_torch_device().current_device())
        dist.all_reduce(t)
        import os

        return {"rank": self.rank, "master_addr": os.environ["MASTER_ADDR"], "world": dist.get_world_size(), "sum": t.item(), "backend": dist.get_backend(),
                "device": get_device_name(), "platform": type(get_platform()).__name__}
