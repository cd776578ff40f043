"""A veRL `Worker` holding the rollout exactly as veRL's `ActorRolloutRefWorker` does (importable by Ray workers).

It builds the rollout with `get_rollout_class(rollout.name, rollout.mode)` and syncs an unmerged adapter with
the very call `verl/workers/engine_workers.py` `update_weights` makes (`peft_config` from
`build_peft_config_for_vllm`, `base_sync_done=True`); the tensors are what the project's Megatron bridge
exports (`dsv4flash.lora.layouts`, `megatron` layout), so no Megatron model is needed here.
"""

from __future__ import annotations

import asyncio

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register


class RolloutSyncWorker(Worker):
    """The rollout side of a hybrid actor worker."""

    def __init__(self, rollout_config):
        super().__init__()
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.rollout.base import get_rollout_class

        config = omega_conf_to_dataclass(rollout_config)  # hydra-instantiated via _target_, as veRL does
        self.rollout = get_rollout_class(config.name, config.mode)(config=config, model_config=None, device_mesh=None)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_weights(self, tensors: dict, lora: dict, global_steps: int, base: dict | None = None):
        """veRL's unmerged-LoRA sync: resume weights, the base first when it was never synced (load_format
        dummy), then the adapter, resume the KV cache."""
        from verl.utils.megatron_peft_utils import build_peft_config_for_vllm

        async def sync():
            await self.rollout.resume(tags=["weights"])
            if base is not None:
                await self.rollout.update_weights(iter(base.items()), peft_config=build_peft_config_for_vllm(lora),
                                                  base_sync_done=False, global_steps=global_steps)
            await self.rollout.update_weights(iter(tensors.items()), peft_config=build_peft_config_for_vllm(lora),
                                              base_sync_done=True, global_steps=global_steps)
            await self.rollout.resume(tags=["kv_cache"])

        asyncio.run(sync())
        return self.rollout.replica_rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def release(self):
        """Put the rollout to sleep, as veRL does before training."""
        asyncio.run(self.rollout.release())
