"""`ServerAdapter`: the rollout object inside each veRL actor worker (`get_rollout_class("dsv4flash")`).

veRL's workers sync weights by calling `rollout.update_weights(weights, peft_config=…, base_sync_done=…,
global_steps=…)` with the generator `engine.get_per_tensor_param()` returns — for an unmerged LoRA the
bridge's adapter tensors and `build_peft_config_for_vllm(lora)` — and `resume(tags)` / `release()` around it
(`verl/workers/engine_workers.py` `update_weights`; `CheckpointEngineWorker.update_weights` in standalone
mode). This adapter receives exactly that and forwards it in buckets of
`rollout.checkpoint_engine.update_weights_bucket_megabytes` through the Ray object store to its replica's
server (`server.DSV4FlashRolloutServer.load_weights`), where vLLM's adapter goes through ZMQ + CUDA IPC. The
rank arithmetic is vLLM's: rank `r` belongs to replica `r // world` and only the replica's rank 0 talks to
the server; every rank still drains the generator, because the bridge's export is collective.
"""

from __future__ import annotations

import os

import ray
import torch

from verl.workers.rollout.base import BaseRollout

from dsv4flash.integrations.verl.rollout.replica import NAME, check_layout


class ServerAdapter(BaseRollout):
    """Client side of a dsv4flash rollout server for veRL's actor workers (hybrid) and checkpoint workers."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        check_layout(self.config)
        rank = int(os.environ.get("RANK", "0"))
        local_world_size = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", "1"))
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size * \
            self.config.pipeline_model_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.node_rank = self.rollout_rank // local_world_size
        self._has_server = self.rollout_rank == 0
        self.server_handle = None
        self.sleep_level = 1  # read by veRL's worker for LoRA syncs; the CPU engine keeps its base either way

    @property
    def is_leader_rank(self) -> bool:
        """Whether this rank talks to the server (veRL's checkpoint workers ask)."""
        return self._has_server

    def _server(self):
        if not self._has_server:
            return None
        if self.server_handle is None:  # the server starts after the hybrid engine: look it up lazily
            self.server_handle = ray.get_actor(f"{NAME}_server_{self.replica_rank}_{self.node_rank}")
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        """Wake the server (`tags`: weights / kv_cache) when veRL frees caches between phases."""
        server = self._server()
        if self.config.free_cache_engine and server is not None:
            await server.wake_up.remote(tags=tags)

    async def release(self) -> None:
        """Put the server to sleep (CPU: nothing is freed)."""
        server = self._server()
        if self.config.free_cache_engine and server is not None:
            await server.sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights, global_steps: int | None = None, wire_format: str = "named_tensors",
                             peft_config: dict | None = None, base_sync_done: bool = False, **kwargs) -> None:
        """Send `weights` ((name, tensor) pairs) to the server in buckets; an adapter applies after the last one."""
        from verl.workers.rollout.utils import ensure_async_iterator

        if wire_format != "named_tensors":
            raise NotImplementedError(f"dsv4flash rollout: wire_format={wire_format!r} is not supported "
                                      f"(allowed: 'named_tensors'; checkpoint_engine.backend delta_sharded is vLLM/SGLang-only)")
        server = self._server()
        limit = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        bucket, size = [], 0

        async def flush(is_last: bool) -> None:
            nonlocal bucket, size
            if server is not None:
                await server.load_weights.remote(bucket, peft_config=peft_config, base_sync_done=base_sync_done,
                                                 is_last=is_last)
            bucket, size = [], 0

        async for name, tensor in ensure_async_iterator(weights):
            t = tensor.detach().to("cpu").contiguous()
            if bucket and size + t.nbytes > limit:
                await flush(False)
            bucket.append((name, t))
            size += t.nbytes
        await flush(True)
        if server is not None:
            await server.clear_kv_cache.remote()
            if global_steps is not None:
                await server.set_global_steps.remote(global_steps)

    def generate_sequences(self, prompts):
        """veRL's async rollout generates through the server (agent loop), never through the adapter."""
        raise NotImplementedError("dsv4flash rollout: generate through the agent loop (async server mode)")
