"""Per-trajectory rollout seeds: a restarted run samples the same responses as an uninterrupted one.

veRL's agent loop knows what identifies every trajectory (`get_trajectory_info`: the trainer step, the
dataset `index` of the prompt, the sample's place in its group `rollout_n`, and whether it validates) but
hands the engine no seed, so an engine either samples from an unseeded stream (vLLM) or, with
`rollout.full_determinism`, from one seed per replica, and which replica serves a request depends on timing.
Neither is in a checkpoint. Here each request's seed is derived from the trajectory and `rollout.seed`, so a
trajectory is sampled the same whichever replica serves it, in whatever order requests arrive, before or
after a restart, while different trajectories (another step, prompt or group member) draw differently.

veRL's own extension point carries it (`actor_rollout_ref.rollout.agent.agent_loop_manager_class`, which
`dsv4flash.train` sets for engine=verl): `TrajectorySeededAgentLoopManager` starts
`TrajectorySeededAgentLoopWorker`s, whose `_run_agent_loop` adds `seed` to the sampling params it passes
on. A `seed` already in the sampling params is kept. Works for every backend that honours vLLM's
`SamplingParams.seed` (vLLM, the dsv4flash rollout server).
"""

from __future__ import annotations

import hashlib
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker

SEED_LIMIT = 2**31 - 1  # engines take a non-negative int32 seed (torch, numpy, vLLM's per-request generator)


def trajectory_seed(rollout_seed: int, trajectory: dict[str, Any]) -> int:
    """The sampling seed of one trajectory (`get_trajectory_info`'s step, sample_index, rollout_n, validate)."""
    try:
        key = (int(rollout_seed), int(trajectory["step"]), int(trajectory["sample_index"]),
               int(trajectory["rollout_n"]), bool(trajectory.get("validate", False)))
    except KeyError as exc:
        raise ValueError(f"trajectory_seed: trajectory {trajectory!r} has no {exc.args[0]!r} "
                         "(expected veRL's get_trajectory_info fields step, sample_index, rollout_n)") from None
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


class TrajectorySeededAgentLoopWorker(AgentLoopWorker):
    """veRL's AgentLoopWorker whose requests carry the trajectory's seed (`trajectory_seed`)."""

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], **kwargs):
        if sampling_params.get("seed") is None:
            seed = trajectory_seed(self.config.actor_rollout_ref.rollout.get("seed", 0) or 0, trajectory)
            sampling_params = {**sampling_params, "seed": seed}
        return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)


class TrajectorySeededAgentLoopManager(AgentLoopManager):
    """veRL's AgentLoopManager starting `TrajectorySeededAgentLoopWorker`s (selected by
    `actor_rollout_ref.rollout.agent.agent_loop_manager_class`)."""

    def __init__(self, *args, **kwargs):
        import ray

        # AgentLoopManager.__init__ sets its own worker class only when none is set yet.
        self.agent_loop_workers_class = ray.remote(TrajectorySeededAgentLoopWorker)
        super().__init__(*args, **kwargs)


__all__ = ["TrajectorySeededAgentLoopManager", "TrajectorySeededAgentLoopWorker",
           "trajectory_seed"]
