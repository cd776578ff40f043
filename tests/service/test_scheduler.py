"""Concurrent multi-policy GRPO gives each policy exactly the weights it gets when run alone."""

import time

import torch

from dsv4flash.service import ServiceClient
from dsv4flash.service.compute.scheduler import GRPOPolicySpec, run_concurrent, run_sequential


def _reward(tokens):
    time.sleep(0.01)  # an environment with real latency
    return float(tokens[-1] % 3 == 0) + tokens[-1] / 1000


def _specs(tag):
    return [GRPOPolicySpec(f"{tag}-p{i}", seed=10 + i, prompts=[[0, 20 + i, 21], [0, 30 + i, 31]], reward_fn=_reward,
                           steps=2, group_size=3, max_tokens=2, rank=2) for i in range(3)]


def test_concurrent_equals_alone(resident, tmp_path):
    alone, _ = run_sequential(ServiceClient(root=tmp_path / "a", resident=resident), _specs("x"))
    together, _ = run_concurrent(ServiceClient(root=tmp_path / "b", resident=resident), _specs("x"))
    for a, b in zip(alone, together):
        assert a.name == b.name and a.rewards == b.rewards
        assert set(a.adapter) == set(b.adapter)
        assert all(torch.equal(a.adapter[k], b.adapter[k]) for k in a.adapter)
        assert len(b.exports) == 2 and b.exports[-1].endswith(f"{b.name}/sampler_weights/step-2")
    # the policies really trained and differ from each other
    k = next(k for k in alone[0].adapter if k.endswith("lora_B.weight"))
    assert alone[0].adapter[k].abs().sum() > 0 and not torch.equal(alone[0].adapter[k], alone[1].adapter[k])


def test_phase_scheduler_runs_one_phase_at_a_time_rollouts_first():
    """While the base is busy, waiting rollouts are granted before waiting updates; phases never overlap."""
    import threading

    from dsv4flash.service.compute.scheduler import PhaseScheduler

    sched = PhaseScheduler()
    active, overlaps = [], []
    release = threading.Event()

    def phase(policy, kind, hold=None):
        with sched.turn(policy, kind):
            active.append(policy)
            if len(active) > 1:
                overlaps.append(tuple(active))
            if hold is not None:
                hold.wait(5)
            time.sleep(0.01)
            active.remove(policy)

    first = threading.Thread(target=phase, args=("a", "update", release))
    first.start()
    while not sched.grants:
        time.sleep(0.001)
    waiters = [threading.Thread(target=phase, args=(p, k)) for p, k in
               (("b", "update"), ("c", "rollout"), ("d", "update"), ("e", "rollout"))]
    for t in waiters:
        t.start()
        time.sleep(0.02)  # arrival order b, c, d, e
    release.set()
    for t in [first, *waiters]:
        t.join()
    assert list(sched.grants) == [("a", "update"), ("c", "rollout"), ("e", "rollout"), ("b", "update"), ("d", "update")]
    assert overlaps == []


def test_phase_scheduler_accounts_idle_time_by_the_phase_it_waited_for():
    from dsv4flash.service.compute.scheduler import PhaseScheduler

    sched = PhaseScheduler()
    with sched.turn("a", "rollout"):
        time.sleep(0.02)
    time.sleep(0.05)  # "a" scores; nobody else wants the base
    with sched.turn("a", "update"):
        time.sleep(0.01)
    with sched.turn("b", "rollout"):
        pass
    assert 0.05 <= sched.idle_s["update"] < 0.05 + 0.04 and sched.idle_s["rollout"] < 0.04
    assert sched.busy_s["rollout"] >= 0.02 and sched.busy_s["update"] >= 0.01
