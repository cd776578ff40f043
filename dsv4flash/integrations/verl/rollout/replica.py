"""`DSV4FlashReplica`: veRL's `RolloutReplica` for the reference engine (`actor_rollout_ref.rollout.name=dsv4flash`).

Like `vLLMReplica` it starts one server actor per node of the replica, pinned to the node of the replica's
workers, named `dsv4flash_server_{replica}_{node}` (what `adapter.ServerAdapter` looks up). The reference
engine runs in one process, so a replica is one rollout rank: tensor and pipeline parallel sizes must be 1
(data parallelism is one replica per worker). In hybrid mode the server shares its workers' CPUs (it requests
none), as vLLM's server shares their GPUs.
"""

from __future__ import annotations

import asyncio

import ray
from verl.workers.rollout.replica import RolloutReplica

from dsv4flash.integrations.verl.rollout.server import DSV4FlashRolloutServer

NAME = "dsv4flash"


def check_layout(config) -> None:
    """Refuse rollout parallel sizes the single-process reference engine cannot run, naming the key."""
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = getattr(config, key, 1)
        if value != 1:
            raise ValueError(f"actor_rollout_ref.rollout.{key}={value}: the dsv4flash rollout runs one process per "
                             f"replica; allowed: 1 (scale with more replicas, i.e. data parallel)")


class DSV4FlashReplica(RolloutReplica):
    """Rollout replica whose servers generate on the dsv4flash reference model."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_layout(self.config)
        self.server_class = ray.remote(DSV4FlashRolloutServer)

    def _get_server_name_prefix(self) -> str:
        return f"{NAME}_"

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        """Start (or, in standalone/colocated mode, next to the workers) one server per node and load the base."""
        if len(self.workers) != self.world_size:
            raise RuntimeError(f"dsv4flash rollout replica {self.replica_rank}: {len(self.workers)} workers for a "
                               f"world size of {self.world_size}")
        node_ids = await asyncio.gather(*[w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                                  for w in self.workers])
        prefix = self._get_server_name_prefix()
        for node_rank in range(self.nnodes):
            role = "reward_" if self.is_reward_model else ("teacher_" if self.is_teacher_model else "")
            name = f"{prefix}server_{role}{self.replica_rank}_{node_rank}{self.name_suffix}"
            server = self.server_class.options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_ids[node_rank * self.gpus_per_replica_node], soft=False),
                name=name, num_cpus=0, max_concurrency=self.max_concurrency,
            ).remote(config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
                     replica_rank=self.replica_rank, node_rank=node_rank)
            self.servers.append(server)
        addresses = await asyncio.gather(*[s.launch.remote() for s in self.servers])
        self._server_handle, self._server_address = self.servers[0], addresses[0]

    async def sleep(self) -> None:
        """Drain, then sleep each server (as vLLM's replica does)."""
        await self.servers[0].wait_for_requests_to_drain.remote()
        await asyncio.gather(*[s.sleep.remote() for s in self.servers])


def load_replica() -> type[DSV4FlashReplica]:
    """`RolloutReplicaRegistry` loader."""
    return DSV4FlashReplica


__all__ = ["DSV4FlashReplica", "check_layout", "load_replica", "NAME"]
