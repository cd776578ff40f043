"""Per-trajectory rollout seeds (`dsv4flash.integrations.verl.trajectory_seed`): the same trajectory is sampled
the same whatever the arrival order, another trajectory differently; the run config selects the seeded agent
loop through veRL's own `agent_loop_manager_class` hook."""

from __future__ import annotations

import asyncio
import inspect
import random

import pytest

pytestmark = [pytest.mark.upstream]

# GRPO layout as veRL's trainer builds it: each prompt repeated n times, interleaved (index = dataset index)
INDEX = [11, 11, 11, 4, 4, 4]


def _trajectories(step: int, validate: bool = False) -> list[dict]:
    from verl.experimental.agent_loop.agent_loop import get_trajectory_info

    return asyncio.run(get_trajectory_info(step, INDEX, validate))


def test_the_seed_is_a_function_of_the_trajectory_and_rollout_seed():
    from dsv4flash.integrations.verl.trajectory_seed import SEED_LIMIT, trajectory_seed

    trajs = _trajectories(step=3)
    assert [t["rollout_n"] for t in trajs] == [0, 1, 2, 0, 1, 2]
    seeds = [trajectory_seed(42, t) for t in trajs]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < SEED_LIMIT for s in seeds)
    assert [trajectory_seed(42, dict(t)) for t in trajs] == seeds  # a function of the fields, nothing else
    others = ([trajectory_seed(42, t) for t in _trajectories(step=4)]
              + [trajectory_seed(43, t) for t in trajs]
              + [trajectory_seed(42, t) for t in _trajectories(step=3, validate=True)])
    assert not set(others) & set(seeds)
    with pytest.raises(ValueError, match="has no 'rollout_n'"):
        trajectory_seed(42, {"step": 1, "sample_index": 0})


def test_same_request_same_sample_in_any_arrival_order(tmp_path):
    """The real rollout server: requests carrying their trajectory's seed, sent concurrently in two different
    orders to two replicas, give each trajectory the same tokens; group members and steps differ."""
    from verl.workers.config import RolloutConfig

    from dsv4flash.config import load_config
    from dsv4flash.engine import model_io
    from dsv4flash.integrations.verl.rollout.server import DSV4FlashRolloutServer
    from dsv4flash.integrations.verl.trajectory_seed import trajectory_seed
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks.tokenizer import TaskTokenizer

    cfg = load_config("tiny")
    base = model_io.save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), tmp_path / "base", {"kind": "test"})
    servers = []
    for replica in (0, 1):
        s = DSV4FlashRolloutServer(RolloutConfig(name="dsv4flash", prompt_length=8, response_length=6, seed=42),
                                   {"path": str(base)}, rollout_mode=None, replica_rank=replica)
        s.launch()
        servers.append(s)
    prompts = {11: [5, 17, 42, 99], 4: [7, 8, 9]}
    requests = [(t, prompts[t["sample_index"]]) for t in _trajectories(1) + _trajectories(2)]

    def run(server, order):
        async def all_of():
            outs = await asyncio.gather(*[
                server.generate(list(ids), {"seed": trajectory_seed(42, t), "logprobs": True}, request_id=str(i))
                for i, (t, ids) in order])
            return {i: o.token_ids for (i, _), o in zip(order, outs)}
        return asyncio.run(all_of())

    numbered = list(enumerate(requests))
    shuffled = numbered[:]
    random.Random(0).shuffle(shuffled)
    first, second = run(servers[0], numbered), run(servers[1], shuffled)
    assert first == second
    # different trajectories draw differently: the group members of one prompt, and the same member a step later
    assert len({tuple(first[i]) for i in range(3)}) > 1
    assert any(first[i] != first[i + len(INDEX)] for i in range(len(INDEX)))


def test_the_run_selects_the_seeded_agent_loop_through_verls_hook():
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker
    from verl.utils.import_utils import load_class_from_fqn

    from dsv4flash.integrations.verl.trajectory_seed import (TrajectorySeededAgentLoopManager,
                                                            TrajectorySeededAgentLoopWorker)
    from dsv4flash.train.verl_config import AGENT_LOOP_MANAGER

    cls = load_class_from_fqn(AGENT_LOOP_MANAGER, "AgentLoopManager")
    assert cls is TrajectorySeededAgentLoopManager and issubclass(cls, AgentLoopManager)
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"seed": 1}, "model": {}}})
    manager = cls(config, llm_client=None)
    assert manager.agent_loop_workers_class.__ray_actor_class__ is TrajectorySeededAgentLoopWorker
    # the override keeps veRL's signature of the method it wraps
    stock = inspect.signature(AgentLoopWorker._run_agent_loop).parameters
    assert list(stock)[:3] == ["self", "sampling_params", "trajectory"]


def test_the_written_config_seeds_rollouts_per_trajectory():
    from dsv4flash.train.compose import compose, to_train_config
    from dsv4flash.train.verl_config import AGENT_LOOP_MANAGER, build_verl_config

    tmp = "/tmp/dsv4flash-verl-seed-test"
    cfg = to_train_config(compose("decoder_lora", ["engine=verl", "model=flash", "model.hf_path=/cluster/V4.1",
                                                   "seed=7"]))
    written = build_verl_config(cfg, data_dir=f"{tmp}/data", output_dir=tmp, reward_path=f"{tmp}/reward.py")
    rollout = written.actor_rollout_ref.rollout
    assert rollout.agent.agent_loop_manager_class == AGENT_LOOP_MANAGER and rollout.seed == 7
    assert not rollout.full_determinism  # reproducible without vLLM's slower full-determinism mode
