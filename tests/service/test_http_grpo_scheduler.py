"""The concurrent multi-policy GRPO scheduler inside `dsv4flash serve`: every core call of every tenant is one turn
of the compute plane's `PhaseScheduler` (the one the in-process `run_concurrent` uses), rollouts before updates;
three real-SDK GRPO clients at once end with exactly the weights each reaches alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tinker import types

import dsv4flash.service as core
from tests.service.http_server import service_client

PROBE = [0, 10, 11, 12, 20, 21, 22]


def _grpo(server, seed: int, steps: int = 2) -> dict:
    """A cookbook-shaped GRPO loop through the SDK -> rewards per step and the final probe log-probs."""
    out = {"rewards": []}
    with service_client(server) as sdk:
        tc = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
        prompts = [[0, 20 + seed, 21, 22], [0, 30 + seed, 31]]
        for step in range(steps):
            sampler = tc.save_weights_and_get_sampling_client().result()
            futures = [sampler.sample(types.ModelInput.from_ints(p), 3, types.SamplingParams(
                max_tokens=3, seed=seed * 1000 + step * 10 + i)) for i, p in enumerate(prompts)]
            groups = [f.result() for f in futures]
            data, total = [], []
            for p, g in zip(prompts, groups):
                rs = [float(t % 2 == 0) for t in (s.tokens[-1] for s in g.sequences)]
                total += rs
                for s, r in zip(g.sequences, rs):
                    toks, ob = p + list(s.tokens), len(p) - 1
                    data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=dict(
                        target_tokens=np.array(toks[1:]), logprobs=np.array([0.0] * ob + list(s.logprobs), np.float32),
                        advantages=np.array([0.0] * ob + [r - np.mean(rs)] * len(s.tokens), np.float32))))
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
            fb.result(), opt.result()
            out["rewards"].append(total)
        probe = types.Datum(model_input=types.ModelInput.from_ints(PROBE[:-1]),
                            loss_fn_inputs={"target_tokens": np.array(PROBE[1:]),
                                            "weights": np.ones(len(PROBE) - 1, np.float32)})
        out["probe"] = tc.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    return out


@pytest.mark.slow
def test_three_concurrent_sdk_grpo_clients_match_each_alone(server):
    alone = [_grpo(server, seed) for seed in range(3)]
    together: list[dict | None] = [None] * 3
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            together[i] = _grpo(server, i)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for a, b in zip(alone, together):
        assert a["rewards"] == b["rewards"]
        np.testing.assert_array_equal(a["probe"], b["probe"])
    assert not np.array_equal(alone[0]["probe"], alone[1]["probe"])  # different seeds: different policies


def test_the_policy_server_runs_core_calls_as_scheduler_turns(resident, tmp_path):
    from dsv4flash.service.plane.policy_server import PolicyServer

    plane = PolicyServer(core.ServiceClient(root=tmp_path, resident=resident))
    try:
        sid = plane.create_session("alice", {})
        model_id = plane.create_model("alice", sid, 0, "tiny", {"rank": 4}, None).result()
        tc = plane.model("alice", model_id)
        datum = core.types.Datum(core.types.ModelInput.from_ints(PROBE[:-1]),
                                 {"target_tokens": PROBE[1:], "weights": [1.0] * (len(PROBE) - 1)})
        tc.forward_backward([datum], "cross_entropy").result()
        snapshot = tc.snapshot_sampling_client().result()  # a copy of the run's adapter: no turn on the base
        sampler_id = plane.add_sampler("alice", sid, snapshot, None)
        snapshot.sample(core.types.ModelInput.from_ints([0, 10]), 1, core.types.SamplingParams(max_tokens=2)).result()
        tc.save_weights_for_sampler("s").result()  # a store write: no turn either
        tc.optim_step(core.types.AdamParams(learning_rate=1e-2)).result()
        run = model_id.replace(":", "-")
        assert list(plane.scheduler.grants) == [(run, "update"), (sampler_id, "rollout"), (run, "update")]
        assert plane.scheduler.busy_s["update"] > 0 and plane.scheduler.busy_s["rollout"] > 0
    finally:
        plane.close()


def test_without_the_phase_scheduler_calls_meet_only_at_the_base_lock(resident, tmp_path):
    from dsv4flash.service.plane.policy_server import PolicyServer

    plane = PolicyServer(core.ServiceClient(root=tmp_path, resident=resident), phase_scheduler=False)
    try:
        sid = plane.create_session("alice", {})
        tc = plane.model("alice", plane.create_model("alice", sid, 0, "tiny", {"rank": 4}, None).result())
        assert plane.scheduler is None and tc._exec.gate is None  # `dsv4flash serve --scheduler lock`
        datum = core.types.Datum(core.types.ModelInput.from_ints(PROBE[:-1]),
                                 {"target_tokens": PROBE[1:], "weights": [1.0] * (len(PROBE) - 1)})
        assert np.isfinite(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
    finally:
        plane.close()
